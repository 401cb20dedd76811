"""Sharded per-sample state (`--state-layout sharded`): each rank holds a block of ⌈N/W⌉ rows of u and of the
per-sample τ tables, exchanged with batch-sized collectives, and saved as per-rank shard files next to OpenCLIP's
checkpoints; a shard set written by W ranks is read back by any other number of ranks.

Loss level (2 gloo processes): sharded = replicated = one process over several steps; the blocks' sizes; a set
saved by 2 ranks read by 1 and 3 ranks, and by either layout. End to end through OpenCLIP: 2-rank sharded
training, a killed run resumed exactly, a 2-rank checkpoint resumed with 1 rank, a missing shard named."""
import functools
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import SGD, loss_tensors, on_gloo_ranks, run_openclip, train_args
from drrho_openclip.losses import create_loss
from drrho_openclip.losses.state import AUTO_SHARD_FROM_SAMPLES, per_sample_tables
from drrho_openclip.losses.state import load_state_shards, save_state_shards, shard_file_name

N = 23  # blocks of 12 + 11 rows over 2 ranks, 8 + 8 + 7 over 3
GLOBAL_BATCH = 12
SCENARIOS = {
    # (loss, options, epochs of the steps): γ < 1 from epoch 1 on, rows revisited (12 of 23 per step)
    'drrho': ('drrho', dict(gamma=0.5, gamma_decay_epochs=1, temperature=0.05, learn_temperature=False),
              (0, 1, 1, 2)),
    'isogclr': ('isogclr', dict(gamma=0.5, gamma_decay_epochs=1, lr_tau=0.01), (0, 1, 1, 2)),
    'isogclr-tau-only': ('isogclr', dict(gamma=1.0, lr_tau=0.01), (0, 1, 1)),  # per-sample τ, no u
}
TABLE_TOL = dict(equal_nan=True, rtol=1e-7, atol=1e-9)


def batch(step):
    g = torch.Generator().manual_seed(step)
    image, text = (F.normalize(torch.randn(GLOBAL_BATCH, 5, generator=g, dtype=torch.float64), dim=1)
                   for _ in range(2))
    ref_image = F.normalize(image[:, :4] + 0.5 * torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64), dim=1)
    ref_text = F.normalize(text[:, :4] + 0.5 * torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64), dim=1)
    return image, text, ref_image, ref_text, torch.randperm(N, generator=g)[:GLOBAL_BATCH]


def build(scenario, rank=0, world_size=1, layout='auto'):
    name, options, _ = SCENARIOS[scenario]
    loss = create_loss(name, num_samples=N, rank=rank, world_size=world_size, state_layout=layout,
                       **options).double()
    loss.set_total_steps(100)  # as a training run does (a learned τ's lr_tau 'auto')
    return loss


def train(loss, scenario, rank, world_size, steps):
    """Each step's loss value (the mean over ranks) and this rank's feature gradients."""
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    out = []
    for step, epoch in steps:
        loss.set_epoch(epoch)
        image, text, ref_image, ref_text, index = batch(step)
        image, text = image[rows].clone().requires_grad_(), text[rows].clone().requires_grad_()
        value = loss(image, text, torch.tensor(15.0, dtype=torch.float64), index=index[rows],
                     ref_image_features=ref_image[rows], ref_text_features=ref_text[rows])
        grads = torch.autograd.grad(value, [image, text])
        value = value.detach().clone()
        if world_size > 1:  # the mean over ranks' anchors
            dist.all_reduce(value)
            value /= world_size
        out.append([value, *grads])
    return out


def tables(loss):
    return {key: getattr(module, key.rsplit('.', 1)[-1]).clone()
            for key, (module, _) in per_sample_tables(loss).items()}


def first_steps(scenario):
    return list(enumerate(SCENARIOS[scenario][2]))


def train_both_layouts(rank, world_size, out_dir):
    """Train with both layouts; save the sharded loss's shard set, and the replicated loss's whole state_dict."""
    results = {}
    for scenario in SCENARIOS:
        for layout in ('replicated', 'sharded'):
            loss = build(scenario, rank, world_size, layout)
            steps = train(loss, scenario, rank, world_size, first_steps(scenario))
            results[scenario, layout] = dict(steps=steps, tables=tables(loss),
                                             block=(loss.sharding.start, loss.sharding.stop))
            if layout == 'sharded':
                results[scenario, 'manifest'] = save_state_shards(loss, out_dir / f'{scenario}.loss_state')
            elif rank == 0:
                torch.save(loss.state_dict(), out_dir / f'{scenario}.replicated.pt')
    return results


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    """What each of 2 gloo ranks computed and saved."""
    out_dir = tmp_path_factory.mktemp('sharded')
    return {2: on_gloo_ranks(functools.partial(train_both_layouts, out_dir=out_dir), 2, out_dir), 'dir': out_dir}


def concatenated(per_rank, scenario, source):
    blocks = [r[scenario, source] for r in per_rank]
    assert [b['block'] for b in blocks] == sorted(b['block'] for b in blocks)
    return {key: torch.cat([b['tables'][key] for b in blocks]) for key in blocks[0]['tables']}


@pytest.mark.parametrize('scenario', list(SCENARIOS))
def test_sharded_equals_replicated_equals_one_process(ranks, scenario):
    single = build(scenario)
    want_steps = train(single, scenario, 0, 1, first_steps(scenario))
    want_tables = tables(single)
    assert all(t.numel() == N for t in want_tables.values())
    for layout in ('replicated', 'sharded'):
        for rank, results in enumerate(ranks[2]):
            rows = slice(rank * GLOBAL_BATCH // 2, (rank + 1) * GLOBAL_BATCH // 2)
            for got, want in zip(results[scenario, layout]['steps'], want_steps):
                torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-12)
                torch.testing.assert_close(got[1], 2 * want[1][rows], rtol=1e-9, atol=1e-12)
                torch.testing.assert_close(got[2], 2 * want[2][rows], rtol=1e-9, atol=1e-12)
    for rank, results in enumerate(ranks[2]):  # the replicated tables are whole on every rank
        for key, value in want_tables.items():
            torch.testing.assert_close(results[scenario, 'replicated']['tables'][key], value, **TABLE_TOL)
    sharded = concatenated(ranks[2], scenario, 'sharded')
    assert sharded.keys() == want_tables.keys()
    for key, value in want_tables.items():
        torch.testing.assert_close(sharded[key], value, **TABLE_TOL)
    assert any(torch.isnan(v).any() for v in want_tables.values()) or scenario == 'isogclr-tau-only'


def test_each_rank_holds_its_block_only(ranks):
    for rank, results in enumerate(ranks[2]):
        for scenario in SCENARIOS:
            got = results[scenario, 'sharded']
            assert got['block'] == [(0, 12), (12, 23)][rank]
            assert {t.numel() for t in got['tables'].values()} == {[12, 11][rank]}
            assert {t.numel() for t in results[scenario, 'replicated']['tables'].values()} == {N}
    files = sorted(p.name for p in (ranks['dir'] / 'isogclr.loss_state').iterdir())
    assert files == [shard_file_name(0, 2), shard_file_name(1, 2)]  # complete, renamed into place


@pytest.mark.parametrize('scenario', list(SCENARIOS))
def test_two_rank_set_reads_back_with_one_and_three_ranks(ranks, scenario):
    """Reading needs no collectives: the ranks of 1- and 3-rank jobs are built side by side in this process."""
    saved = concatenated(ranks[2], scenario, 'sharded')
    manifest = ranks[2][0][scenario, 'manifest']
    shards = ranks['dir'] / f'{scenario}.loss_state'
    replicated = torch.load(ranks['dir'] / f'{scenario}.replicated.pt')
    for world_size, layout, blocks in ((1, 'replicated', [(0, 23)]), (1, 'sharded', [(0, 23)]),
                                       (3, 'sharded', [(0, 8), (8, 16), (16, 23)]),
                                       (3, 'replicated', [(0, 23)] * 3)):
        for source in ('shards', 'replicated tables'):
            for rank, (start, stop) in enumerate(blocks):
                loss = build(scenario, rank, world_size, layout)
                loss.load_state_dict(load_state_shards(loss, shards, manifest) if source == 'shards' else replicated)
                assert (loss.sharding.start, loss.sharding.stop) == (start, stop)
                for key, value in tables(loss).items():
                    torch.testing.assert_close(value, saved[key][start:stop], equal_nan=True, rtol=0, atol=0)
    # and a sharded loss's own state_dict (its block) goes back into the same rank
    loss = build(scenario, 1, 2, 'sharded')
    loss.load_state_dict({key: value[12:] for key, value in saved.items()})
    for key, value in tables(loss).items():
        torch.testing.assert_close(value, saved[key][12:], equal_nan=True, rtol=0, atol=0)


def test_incomplete_or_foreign_shard_sets_are_named(ranks, tmp_path):
    import shutil
    manifest = ranks[2][0]['isogclr', 'manifest']
    one = build('isogclr')
    broken = tmp_path / 'isogclr.loss_state'
    shutil.copytree(ranks['dir'] / 'isogclr.loss_state', broken)
    (broken / shard_file_name(1, 2)).unlink()
    with pytest.raises(RuntimeError, match=f"shard '{broken / shard_file_name(1, 2)}' is missing"):
        load_state_shards(one, broken, manifest)
    shutil.copy(ranks['dir'] / 'drrho.loss_state' / shard_file_name(1, 2), broken / shard_file_name(1, 2))
    with pytest.raises(RuntimeError, match=rf"shard '{broken / shard_file_name(1, 2)}' does not belong.*save_id"):
        load_state_shards(one, broken, manifest)
    (broken / shard_file_name(1, 2)).write_bytes(b'truncated')
    with pytest.raises(RuntimeError, match=f"shard '{broken / shard_file_name(1, 2)}' cannot be read"):
        load_state_shards(one, broken, manifest)
    with pytest.raises(RuntimeError, match="directory .* is missing"):
        load_state_shards(one, tmp_path / 'nowhere', manifest)
    # drrho's set has no τ tables; isogclr keeps them at any γ, so the advice is the loss and its options, not γ
    with pytest.raises(RuntimeError, match=r"holds no per-sample state \(temperature\..*tau_image.*same --loss and "
                                           r"options$"):
        load_state_shards(one, ranks['dir'] / 'drrho.loss_state', ranks[2][0]['drrho', 'manifest'])


class _HostReadsAndWrites(TorchDispatchMode):
    """What a state write does: the index writes (the rows and values of each), and every op that reads a value back
    to the host (`.item()`, `nonzero`, a mask's selection: the count of its rows), which waits for the device."""
    WAITS = (torch.ops.aten.nonzero, torch.ops.aten._local_scalar_dense, torch.ops.aten.masked_select,
             torch.ops.aten.is_nonzero, torch.ops.aten.equal)

    def __init__(self):
        super().__init__()
        self.writes, self.waits = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indexing = func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put_, torch.ops.aten.index_put)
        if func.overloadpacket in self.WAITS or indexing and any(i is not None and i.dtype == torch.bool
                                                                  for i in args[1]):
            self.waits.append(str(func))
        if func.overloadpacket in (torch.ops.aten.index_put_, torch.ops.aten.index_put):
            self.writes.append((args[1][0].clone(), args[2].clone()))
        return func(*args, **(kwargs or {}))


def write_twice(rank, world_size, layout):
    """Rank r's writes of two global batches of a 10-row table: one where samples 3 and 7 come twice (7 on both
    ranks), one in which rank 1 owns no row of the sharded layout (rows 0-4 on rank 0, 5-9 on rank 1)."""
    from drrho_openclip.losses import state
    state.check_index = lambda index, rows: None  # exact on the CPU, by design (a device-side assertion elsewhere)
    sharding = state.SampleSharding(10, rank, world_size, layout)
    table = torch.full((sharding.size if sharding.sharded else 10,), -1.0)
    batches = [([3, 7, 3], [1, 7, 8]), ([0, 1], [2, 3])]
    values = [([0.1, 0.2, 0.3], [0.4, 0.5, 0.6]), ([0.7, 0.8], [0.9, 1.0])]
    with _HostReadsAndWrites() as seen:
        for index, value in zip(batches, values):
            sharding.write([table], torch.tensor(index[rank]), [torch.tensor(value[rank])])
    return dict(table=table, writes=seen.writes, waits=seen.waits, start=sharding.start if sharding.sharded else 0)


@pytest.mark.parametrize('layout', ['replicated', 'sharded'])
def test_a_sample_twice_in_a_batch_writes_one_value_without_waiting_for_the_device(layout, tmp_path):
    """--dataset-resampled can put a sample twice in a global batch. CUDA writes repeated indices in an undefined
    order (each rank's replicated table could keep another value): every write of a row now carries one value, its
    last occurrence's, which the CPU's last write kept. And a sharded write selected its owned rows with a mask,
    whose count waited for the device at every step: no write reads anything back to the host."""
    want = torch.tensor([0.7, 0.8, 0.9, 1.0, -1, -1, -1, 0.5, 0.6, -1])
    for result in on_gloo_ranks(functools.partial(write_twice, layout=layout), 2, tmp_path):
        assert not result['waits'], result['waits']
        assert result['writes']
        for rows, written in result['writes']:
            for row in rows.unique():
                assert len(written[rows == row].unique()) == 1, (rows, written)
        start = result['start']
        assert result['table'].tolist() == want[start:start + len(result['table'])].tolist()


def test_layout_option():
    assert build('drrho').sharding.layout == 'replicated'  # one rank: one block either way
    big = create_loss('sogclr', num_samples=AUTO_SHARD_FROM_SAMPLES, rank=1, world_size=2)
    assert big.sharding.sharded and big.state.log_u_image.numel() == AUTO_SHARD_FROM_SAMPLES // 2
    small = create_loss('sogclr', num_samples=AUTO_SHARD_FROM_SAMPLES - 1, rank=1, world_size=2)
    assert not small.sharding.sharded and small.state.log_u_image.numel() == AUTO_SHARD_FROM_SAMPLES - 1
    with pytest.raises(ValueError, match=r'state_layout has no effect here \(gamma = 1 keeps no per-sample state'):
        create_loss('drrho', num_samples=N, gamma=1.0, state_layout='sharded')
    with pytest.raises(ValueError, match='state_layout must be one of'):
        create_loss('drrho', num_samples=N, gamma=0.5, state_layout='striped')
    with pytest.raises(ValueError, match='no option state_layout'):
        create_loss('jest', state_layout='sharded')


def test_flag_is_rejected_where_there_are_no_tables(capsys):
    from open_clip_train.params import parse_args
    assert parse_args(['--loss', 'isogclr', '--gamma', '1', '--state-layout', 'sharded']).state_layout == 'sharded'
    assert parse_args(['--loss', 'sogclr']).state_layout == 'auto'
    for argv, message in ((['--loss', 'clip', '--state-layout', 'sharded'], '--state-layout: no such option'),
                          (['--loss', 'drrho', '--ref-model', 'RN50', '--gamma', '1', '--state-layout', 'replicated'],
                           '--state-layout has no effect for --loss drrho with these flags (gamma = 1 keeps no '
                           'per-sample state to lay out)'),
                          (['--loss', 'sogclr', '--state-layout', 'striped'], 'invalid choice')):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# End to end through OpenCLIP: checkpoints/epoch_N.pt + checkpoints/epoch_N.loss_state/rank-R-of-W.shard

ISOGCLR = ('--loss', 'isogclr', '--gamma', '0.5', '--lr-tau', '0.01', '--state-layout', 'sharded')
TWO_RANKS = ('--local-loss', '--gather-with-grad')


def saved_tables(checkpoint_file):
    """The whole per-sample tables of a checkpoint: in it (one rank), or assembled from its shard set."""
    from drrho_openclip.openclip.checkpoints import SHARDS_KEY
    state = loss_tensors(torch.load(checkpoint_file, map_location='cpu'))
    if SHARDS_KEY not in state:
        return state
    manifest = state[SHARDS_KEY]
    directory = Path(checkpoint_file).parent / manifest['directory']
    shards = [torch.load(directory / shard_file_name(r, manifest['world_size'])) for r in
              range(manifest['world_size'])]
    assert all(s['save_id'] == manifest['save_id'] for s in shards)
    return {key: torch.cat([s['tables'][key] for s in shards]) for key in manifest['tables']}


@pytest.fixture(scope='module')
def two_rank_run(shapes, tmp_path_factory):
    logs = tmp_path_factory.mktemp('sharded_runs')
    run_openclip(train_args(shapes, logs, 'full', *ISOGCLR, *SGD, *TWO_RANKS, '--save-most-recent', batch_size=4,
                            epochs=2), nproc=2)
    return logs


def test_two_ranks_save_shard_sets_next_to_the_checkpoints(two_rank_run):
    from drrho_openclip.openclip.checkpoints import RUN_KEY, SHARDS_KEY
    root = two_rank_run / 'full' / 'checkpoints'
    files = sorted(str(p.relative_to(root)) for p in root.rglob('*') if p.is_file())
    assert files == ['epoch_1.loss_state/rank-0-of-2.shard', 'epoch_1.loss_state/rank-1-of-2.shard', 'epoch_1.pt',
                     'epoch_2.loss_state/rank-0-of-2.shard', 'epoch_2.loss_state/rank-1-of-2.shard', 'epoch_2.pt',
                     'epoch_latest.pt']
    assert sorted(p.name for p in root.glob('**/*.pt')) == ['epoch_1.pt', 'epoch_2.pt', 'epoch_latest.pt']
    for name, epoch in (('epoch_2.pt', 2), ('epoch_latest.pt', 2), ('epoch_1.pt', 1)):
        state = torch.load(root / name, map_location='cpu')['loss_state']
        assert set(state) == {SHARDS_KEY, RUN_KEY} and state[SHARDS_KEY]['directory'] == f'epoch_{epoch}.loss_state'
        assert state[SHARDS_KEY]['world_size'] == 2
    shard = torch.load(root / 'epoch_2.loss_state' / 'rank-1-of-2.shard')
    assert (shard['start'], shard['stop']) == (32, 64) and len(shard['tables']) == 8  # u, τ, m, v per modality
    assert all(t.shape == (32,) for t in shard['tables'].values())
    tables = saved_tables(root / 'epoch_2.pt')
    assert all(torch.isfinite(t).all() for t in tables.values())  # every sample visited


def test_killed_two_rank_run_resumes_exactly(shapes, two_rank_run):
    from conftest import ENV, kill_process_tree, openclip_command
    args = lambda *extra: train_args(shapes, two_rank_run, 'split', *ISOGCLR, *SGD, *TWO_RANKS, *extra,
                                     batch_size=4, epochs=2)
    process = subprocess.Popen(openclip_command(args(), nproc=2), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=ENV)
    first, second = (two_rank_run / 'split' / 'checkpoints' / f'epoch_{e}.pt' for e in (1, 2))
    while not first.exists() and process.poll() is None:  # however long the machine takes
        time.sleep(0.05)
    killed = kill_process_tree(process)
    assert len(killed) >= 3  # torchrun and both workers: none trains on to write the checkpoints compared below
    assert first.exists()
    second.unlink(missing_ok=True)  # had it got that far, resume from epoch 1 all the same
    run_openclip(args('--resume', 'latest'), nproc=2)
    a, b = (torch.load(two_rank_run / run / 'checkpoints' / 'epoch_2.pt', map_location='cpu') for run in
            ('full', 'split'))
    for key in a['state_dict']:
        torch.testing.assert_close(a['state_dict'][key], b['state_dict'][key], rtol=0, atol=0)
    want, got = (saved_tables(two_rank_run / run / 'checkpoints' / 'epoch_2.pt') for run in ('full', 'split'))
    for key in want:
        torch.testing.assert_close(got[key], want[key], equal_nan=True, rtol=0, atol=0)
    leftovers = [p.name for p in (two_rank_run / 'split' / 'checkpoints').iterdir() if '.tmp' in p.name]
    assert not leftovers


def test_one_rank_resumes_a_two_rank_sharded_checkpoint(shapes, two_rank_run, tmp_path):
    full = two_rank_run / 'full' / 'checkpoints'
    replicated = [*ISOGCLR[:-1], 'replicated']  # where the rows live changes no value: no warning of a change
    result = run_openclip(train_args(shapes, tmp_path, 'one', *replicated, *SGD, '--resume', full / 'epoch_1.pt',
                                     batch_size=8, epochs=2))
    assert 'was trained with other --loss isogclr options' not in result.stdout + result.stderr
    one = torch.load(tmp_path / 'one' / 'checkpoints' / 'epoch_2.pt', map_location='cpu')
    two = torch.load(full / 'epoch_2.pt', map_location='cpu')
    for key, value in one['state_dict'].items():  # the same global batch: the same training
        torch.testing.assert_close(value, two['state_dict']['module.' + key], rtol=1e-4, atol=1e-5)
    assert set(loss_tensors(one)) == set(saved_tables(full / 'epoch_2.pt'))  # one rank: the tables in the file
    for key, value in saved_tables(full / 'epoch_2.pt').items():
        torch.testing.assert_close(one['loss_state'][key], value, equal_nan=True, rtol=1e-3, atol=1e-3)


def test_missing_shard_stops_the_resume_and_names_the_file(shapes, two_rank_run, tmp_path):
    import shutil
    source = two_rank_run / 'full' / 'checkpoints'
    copy = tmp_path / 'copy'
    copy.mkdir()
    shutil.copy(source / 'epoch_1.pt', copy / 'epoch_1.pt')
    shutil.copytree(source / 'epoch_1.loss_state', copy / 'epoch_1.loss_state')
    missing = copy / 'epoch_1.loss_state' / 'rank-1-of-2.shard'
    missing.unlink()
    result = run_openclip(train_args(shapes, tmp_path, 'resumed', *ISOGCLR, *SGD, '--resume', copy / 'epoch_1.pt',
                                     epochs=2), check=False)
    assert result.returncode != 0
    assert f"per-sample state shard '{missing}' is missing" in result.stderr
    assert f"--resume '{copy / 'epoch_1.pt'}': the per-sample state shard" in result.stderr
    assert 'Traceback' not in result.stderr  # a message, not a traceback on every rank
    assert not (tmp_path / 'resumed' / 'checkpoints' / 'epoch_2.pt').exists()


def test_a_link_to_a_sharded_checkpoint_reads_the_set_next_to_the_file(shapes, two_rank_run, tmp_path):
    """--resume best.pt, a link to epoch_1.pt elsewhere: the shard set is next to the file the link names."""
    link = tmp_path / 'best.pt'
    link.symlink_to(two_rank_run / 'full' / 'checkpoints' / 'epoch_1.pt')
    result = run_openclip(train_args(shapes, tmp_path, 'resumed', *ISOGCLR, *SGD, '--resume', link, epochs=2))
    assert f"per-sample state read from '{two_rank_run / 'full' / 'checkpoints' / 'epoch_1.loss_state'}'" in \
        result.stdout + result.stderr


def test_a_remote_checkpoint_with_a_shard_set_stops_with_a_message(shapes, two_rank_run, tmp_path):
    """--remote-sync's --resume latest is a URL, whose shard set cannot be read as files: the run stops saying so
    (it was a traceback)."""
    url = (two_rank_run / 'full' / 'checkpoints' / 'epoch_1.pt').as_uri()
    result = run_openclip(train_args(shapes, tmp_path, 'resumed', *ISOGCLR, *SGD, '--resume', url, epochs=2),
                          check=False)
    assert result.returncode != 0
    assert (f"--resume '{url}': its per-sample state is a shard set next to it ('epoch_1.loss_state'), which is read "
            f"from files: resume from a local or mounted copy of the checkpoint folder") in result.stderr
    assert 'Traceback' not in result.stderr


def test_shard_sets_of_deleted_checkpoints_are_removed(tmp_path):
    from drrho_openclip.openclip.checkpoints import remove_unreferenced_shard_sets
    root = tmp_path / 'checkpoints'
    for name in ('epoch_1.loss_state', 'epoch_2.loss_state', 'epoch_3.loss_state', 'epoch_3.loss_state.tmp-ab12',
                 'epoch_2.loss_state.old-cd34', 'other.loss_state'):
        (root / name).mkdir(parents=True)
    for name in ('epoch_2.pt', 'epoch_3.pt'):  # epoch_1.pt deleted (--delete-previous-checkpoint)
        (root / name).write_bytes(b'')
    remove_unreferenced_shard_sets(root, 3, [str(root / 'epoch_3.pt')])  # what --save-frequency 1 writes
    assert sorted(p.name for p in root.iterdir()) == ['epoch_2.loss_state', 'epoch_2.pt', 'epoch_3.loss_state',
                                                      'epoch_3.pt', 'other.loss_state']
    (root / 'epoch_4.loss_state').mkdir()
    (root / 'epoch_2.pt').unlink()
    # --save-most-recent --save-frequency 0: epoch_latest.pt alone, which refers to the newest set only
    remove_unreferenced_shard_sets(root, 4, [str(root / 'epoch_latest.pt')])
    assert sorted(p.name for p in root.iterdir()) == ['epoch_3.loss_state', 'epoch_3.pt', 'epoch_4.loss_state',
                                                      'other.loss_state']


def test_a_killed_save_and_a_dangling_link_do_not_keep_the_sets_of_deleted_checkpoints(tmp_path, caplog):
    """OpenCLIP's tmp.pt of a save killed while writing epoch_latest.pt, and a link to a deleted checkpoint, kept
    every set from then on (a set per epoch, 8 bytes a sample each); another unreadable file keeps them, and says
    so."""
    from drrho_openclip.openclip.checkpoints import remove_unreferenced_shard_sets
    root = tmp_path / 'checkpoints'
    for name in ('epoch_1.loss_state', 'epoch_2.loss_state', 'epoch_3.loss_state'):
        (root / name).mkdir(parents=True)
    (root / 'epoch_3.pt').write_bytes(b'')
    (root / 'tmp.pt').write_bytes(b'half a checkpoint')
    (root / 'best.pt').symlink_to(root / 'epoch_1.pt')  # epoch_1.pt deleted by --delete-previous-checkpoint
    remove_unreferenced_shard_sets(root, 3, [str(root / 'epoch_3.pt')])
    assert sorted(p.name for p in root.glob('*.loss_state')) == ['epoch_3.loss_state']
    (root / 'epoch_2.loss_state').mkdir()  # no checkpoint names it, but one that cannot be read might
    (root / 'epoch_4.loss_state').mkdir()
    (root / 'notes.pt').write_bytes(b'not a checkpoint')
    remove_unreferenced_shard_sets(root, 4, [str(root / 'epoch_4.pt')])
    assert sorted(p.name for p in root.glob('*.loss_state')) == ['epoch_2.loss_state', 'epoch_3.loss_state',
                                                                 'epoch_4.loss_state']
    assert f"'{root / 'notes.pt'}' cannot be read, so every per-sample state set" in caplog.text


def test_a_run_that_does_not_shard_removes_the_sets_of_a_sharded_checkpoint_it_resumed(tmp_path):
    from types import SimpleNamespace
    from drrho_openclip.openclip.checkpoints import checkpoints_saved
    root = tmp_path / 'checkpoints'
    (root / 'epoch_1.loss_state').mkdir(parents=True)  # a two-rank sharded run's, resumed here on one rank
    (root / 'epoch_2.loss_state').mkdir()
    (root / 'epoch_2.pt').write_bytes(b'')
    replicated = SimpleNamespace(loss=build('isogclr'))
    assert not replicated.loss.sharding.sharded
    checkpoints_saved(replicated, 3, [str(root / 'epoch_3.pt')], SimpleNamespace(rank=0))
    assert sorted(p.name for p in root.iterdir()) == ['epoch_2.loss_state', 'epoch_2.pt']


def test_a_shard_set_saved_again_replaces_the_first(tmp_path):
    """The same epoch saved twice (a run resumed from an earlier checkpoint): the second set replaces the first,
    which is moved aside until then, and nothing of either save is left beside it."""
    loss = build('isogclr', layout='sharded')
    train(loss, 'isogclr', 0, 1, first_steps('isogclr'))
    directory = tmp_path / 'epoch_1.loss_state'
    first = save_state_shards(loss, str(directory))
    train(loss, 'isogclr', 0, 1, [(9, 2)])
    second = save_state_shards(loss, str(directory))
    assert second['save_id'] != first['save_id']
    assert [p.name for p in tmp_path.iterdir()] == ['epoch_1.loss_state']
    saved = load_state_shards(build('isogclr', layout='sharded'), str(directory), second)
    for key, value in tables(loss).items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, equal_nan=True)


def node_local_folders(rank, world_size, root, what):
    """Each rank lists a checkpoint folder of its own: rank 1's holds only epoch 1, as a node-local --logs, or a
    shared folder's stale listing under load, shows it."""
    from types import SimpleNamespace
    from drrho_openclip.openclip import checkpoints
    from drrho_openclip.openclip.checkpoints import check_checkpoint_folder_shared, check_resumed_loss
    checkpoints.MARK_WAIT_SECONDS = 0  # no file system here shows the mark late
    folder = Path(root) / f'rank{rank}' / 'checkpoints'
    args = SimpleNamespace(rank=rank, world_size=world_size, distributed=True, device='cpu', train_data=None,
                           dataset_type='auto', logs=str(Path(root) / f'rank{rank}'), checkpoint_path=str(folder),
                           resume=str(folder / 'epoch_1.pt'))
    if what == 'unsearchable on rank 1' and rank == 1:  # a mount the rank's user cannot search (root can)
        def unsearchable(path):
            raise PermissionError(13, 'Permission denied', str(path))
        Path.exists = unsearchable
    try:
        if what.startswith('resume latest'):
            check_resumed_loss(None, SimpleNamespace(resume_latest=True, loss_name='clip'), args)
            return args.resume
        check_checkpoint_folder_shared(args, torch.device('cpu'))
    except SystemExit as e:  # every rank, where one rank alone stopping would leave the others waiting
        return str(e)
    return 'passed'


def _node_local(tmp_path, what):
    for rank, epochs in ((0, (1, 2)), (1, (1,))):
        folder = tmp_path / f'rank{rank}' / 'checkpoints'
        folder.mkdir(parents=True)
        for epoch in epochs:
            torch.save({'epoch': epoch, 'state_dict': {}}, folder / f'epoch_{epoch}.pt')
    if what == 'resume latest, a damaged epoch_latest.pt':
        (tmp_path / 'rank0' / 'checkpoints' / 'epoch_latest.pt').write_bytes(b'damaged')
    return on_gloo_ranks(functools.partial(node_local_folders, root=str(tmp_path), what=what), 2, tmp_path)


def test_resume_latest_resumes_rank_0s_pick_on_every_rank(tmp_path):
    # each rank picked from its own listing: rank 0 resumed epoch 2, rank 1 epoch 1, and they trained apart
    assert _node_local(tmp_path, 'resume latest') == [str(tmp_path / 'rank0' / 'checkpoints' / 'epoch_2.pt')] * 2


def test_a_pick_that_fails_on_rank_0_stops_every_rank(tmp_path):
    # rank 0 alone reads the folder: had it stopped alone, the others would wait for its pick
    stopped = _node_local(tmp_path, 'resume latest, a damaged epoch_latest.pt')
    assert len(stopped) == 2 and all(
        s.startswith("drrho-openclip: --resume latest: rank 0 could not choose the checkpoint to resume in "
                     f"'{tmp_path / 'rank0' / 'checkpoints'}': ") for s in stopped), stopped


def test_resume_latest_says_nothing_where_it_resumes_openclips_pick(tmp_path, monkeypatch, caplog):
    """With --logs' default './logs/', OpenCLIP's pick keeps the './' and the plugin's did not: every resume warned
    that it resumed another file than OpenCLIP's, the same one."""
    from types import SimpleNamespace
    from drrho_openclip.openclip.checkpoints import check_resumed_loss
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / 'logs' / 'run' / 'checkpoints'
    folder.mkdir(parents=True)
    for epoch in (1, 2):
        torch.save({'epoch': epoch, 'state_dict': {}}, folder / f'epoch_{epoch}.pt')
    checkpoint_path = os.path.join('./logs/', 'run', 'checkpoints')  # as OpenCLIP joins them
    args = SimpleNamespace(rank=0, world_size=1, distributed=False, device='cpu', train_data=None,
                           dataset_type='auto', checkpoint_path=checkpoint_path,
                           resume=os.path.join(checkpoint_path, 'epoch_2.pt'))
    check_resumed_loss(None, SimpleNamespace(resume_latest=True, loss_name='clip'), args)
    assert os.path.samefile(args.resume, folder / 'epoch_2.pt') and 'resume latest' not in caplog.text


@pytest.mark.parametrize('what', ['shared folder', 'unsearchable on rank 1'])
def test_sharded_state_stops_at_start_up_where_ranks_do_not_share_the_checkpoint_folder(tmp_path, what):
    # each rank writes its block of the state next to rank 0's checkpoints: this failed at the first save
    expected = [f"drrho-openclip: 1 of 2 ranks do not see the checkpoint folder "
                f"'{tmp_path / f'rank{rank}' / 'checkpoints'}' that rank 0 writes, and with the per-sample state "
                "sharded every rank writes its block there: give --logs a folder every node shares, or "
                "--state-layout replicated" for rank in (0, 1)]
    assert _node_local(tmp_path, what) == expected
    assert not list((tmp_path / 'rank0' / 'checkpoints').glob('.drrho*'))  # the mark is gone
