"""Loss fwd+bwd time (bf16, interleaved rounds) and peak memory of a few losses at the users' batches."""
import concurrent.futures, json, os, statistics, sys
sys.path.insert(0, 'benchmarks')
import torch
import overheads as o
from drrho_openclip.losses import list_losses
out = os.environ.get('OUT', '/tmp')
sizes = [int(s) for s in sys.argv[1].split(',')]
mem_sizes = [int(s) for s in sys.argv[2].split(',')] if len(sys.argv) > 2 else []
names = [o.BASELINE, *list_losses()]
times = o.time_losses(names, sizes, 512, sys.argv[3] if len(sys.argv) > 3 else 'cuda', 'bf16', 5)
ratios = {b: {n: statistics.median(x / y for x, y in zip(t[n], t[o.BASELINE])) for n in names} for b, t in times.items()}
json.dump(dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu', torch=torch.__version__,
               seconds={str(b): t for b, t in times.items()}, ratios={str(b): r for b, r in ratios.items()}),
          open(f'{out}/loss_times_bf16.json', 'w'), indent=1)
print('| B | ' + ' | '.join(names) + ' |')
for b in sizes:
    print(f'| {b} | {statistics.median(times[b][o.BASELINE]) * 1e3:.1f} ms | '
          + ' | '.join(f'{ratios[b][n]:.2f}x' for n in names[1:]) + ' |', flush=True)
if torch.cuda.is_available():
    torch.cuda.empty_cache()
memory = {}
for b in mem_sizes:
    chosen = [o.BASELINE, 'drrho', 'adnce', 'balanced']
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda n: o.in_fresh_process('--memory-worker', n, b, 512, sys.argv[3] if len(sys.argv) > 3 else 'cuda', 'bf16'), chosen))
    memory[b] = {n: r['peak_bytes'] for n, r in zip(chosen, outs)}
    print(f'peak B={b}: ' + ', '.join(f'{n} {v / 2**20:.0f} MiB ({v / memory[b][o.BASELINE]:.2f}x)' for n, v in memory[b].items()), flush=True)
    json.dump({str(k): v for k, v in memory.items()}, open(f'{out}/loss_memory_bf16.json', 'w'), indent=1)
