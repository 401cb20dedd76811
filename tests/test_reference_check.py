"""`drrho-openclip-features check`: the reference's retrieval, its margins and the DRO weights' effective number of
negatives, against float64 computations from their definitions, and the verdict a user reads."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from drrho_openclip.features import FeatureStoreWriter
from drrho_openclip.reference_check import (FULL_SHIFT_EVIDENCE, FULL_SHIFT_MAX_TARGET_FRACTION,
                                            SUGGESTED_TEMPERATURE, TARGET_NEGATIVES, batch_margins, check,
                                            effective_negatives, main, random_batches, retrieval, retrieval_ranks)


def write_store(root, image, text, dtype='float32'):
    writer = FeatureStoreWriter(root, 'm', '', dim=image.shape[1], dtype=dtype)
    writer.add_shard('part', [f'k{i}' for i in range(len(image))], image, text)
    writer.close()
    return root


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_effective_negatives_from_the_definition():
    g = torch.Generator().manual_seed(0)
    margins = torch.randn(7, 9, generator=g, dtype=torch.float64) * 0.3
    for tau in (0.01, 0.1, 1.0):
        got = effective_negatives(margins, tau)
        for row, m in zip(got, margins):
            p = np.exp(m.numpy() / tau - np.max(m.numpy() / tau))
            p /= p.sum()
            assert row.item() == pytest.approx(np.exp(-(p[p > 0] * np.log(p[p > 0])).sum()), rel=1e-9)
    assert torch.allclose(effective_negatives(torch.zeros(3, 9, dtype=torch.float64), 0.05),
                          torch.full((3,), 9.0, dtype=torch.float64))  # equal margins: every negative counts


def test_copies_of_the_own_caption_tie_with_it_and_a_nan_score_is_a_miss():
    """The product rounds identical columns differently by their place: copies of a sample's own caption (or image)
    scored above it, and every caption identical was an R@1 of 40 %, not 100 %. NaN features scored as found."""
    g = torch.Generator().manual_seed(5)
    image = torch.randn(5, 32, generator=g, dtype=torch.float64)
    assert retrieval(image, image[:1].repeat(5, 1))['image_to_text_R@1'] == 100.0
    text = torch.randn(5, 32, generator=g, dtype=torch.float64)
    assert retrieval(image, text[[0, 1, 1, 1, 1]], chunk=2) == retrieval(image, text[[0, 1, 1, 1, 1]])
    broken = image.clone()
    broken[2] = float('nan')
    ranks = retrieval_ranks(broken, text)
    assert ranks['image_to_text'][2] == 5 and ranks['text_to_image'][2] == 5
    assert retrieval(torch.full((10, 4), float('nan')), torch.full((10, 4), float('nan'))) == {
        f'{d}_R@{k}': 0.0 for d in ('image_to_text', 'text_to_image') for k in (1, 5)}


def test_retrieval_and_margins_from_the_definition():
    g = torch.Generator().manual_seed(1)
    image = torch.nn.functional.normalize(torch.randn(50, 8, generator=g, dtype=torch.float64), dim=1)
    text = torch.nn.functional.normalize(image + 0.7 * torch.randn(50, 8, generator=g, dtype=torch.float64), dim=1)
    sim = (image @ text.T).numpy()
    expected = {}
    for name, s in (('image_to_text', sim), ('text_to_image', sim.T)):
        ranks = [(row > row[i]).sum() for i, row in enumerate(s)]
        for k in (1, 5):
            expected[f'{name}_R@{k}'] = 100 * np.mean([r < k for r in ranks])
    assert retrieval(image, text) == pytest.approx(expected)
    assert retrieval(image, text, chunk=7) == pytest.approx(expected)  # anchors in chunks, the last one short
    pick = torch.randperm(50, generator=torch.Generator().manual_seed(1))[:10]
    margins = batch_margins([(image[pick], text[pick])] * 2)
    assert margins.shape == (2 * 2 * 10, 9)
    # the image anchors: s_ii − s_ij over the batch's 9 other texts, in column order
    block = sim[np.ix_(pick.numpy(), pick.numpy())]
    expected = np.stack([block[i, i] - np.delete(block[i], i) for i in range(10)])
    np.testing.assert_allclose(margins[:10].numpy(), expected, rtol=1e-12)
    # the text anchors of the same batch: the transposed block
    expected_text = np.stack([block[i, i] - np.delete(block[:, i], i) for i in range(10)])
    np.testing.assert_allclose(margins[10:20].numpy(), expected_text, rtol=1e-12)
    # a large batch contributes its first anchors, each over all of its negatives
    np.testing.assert_allclose(batch_margins([(image[pick], text[pick])], max_anchors=3).numpy(),
                               np.concatenate([expected[:3], expected_text[:3]]), rtol=1e-12)


def test_batches_are_drawn_from_the_whole_store(tmp_path):
    """The batches are of the size asked, of distinct samples of the whole store, however few --samples retrieval
    is measured among; a batch larger than the store is the store, and the verdict says so."""
    rng = np.random.default_rng(3)
    image = unit(rng.standard_normal((400, 16)))
    store = write_store(tmp_path / 's', image, unit(image + 0.5 * rng.standard_normal((400, 16))))
    from drrho_openclip.features import FeatureStore
    for image_batch, text_batch in random_batches(FeatureStore.open(store), 300, 2, seed=0):
        assert image_batch.shape == (300, 16) and len({tuple(row.tolist()) for row in image_batch}) == 300
        assert torch.allclose((image_batch * text_batch).sum(1).max(), torch.tensor(1.0, dtype=torch.float64),
                              atol=0.5)  # each row's own caption
    report = check(store, batch_size=300, samples=50)
    assert report.samples == 50 and report.batch_size == 300
    assert report.effective_negatives[0.2] > 50  # weights over a batch's 299 negatives, not the 49 of the sample
    assert not any(line.startswith('The store holds') for line in report.verdict)
    capped = check(store, batch_size=1000)
    assert capped.batch_size == 400 and capped.batch_size_asked == 1000
    assert any(line.startswith('The store holds 400 samples, fewer than a batch of 1000') for line in capped.verdict)


def test_a_faithful_reference_beats_a_random_one(tmp_path):
    rng = np.random.default_rng(0)
    image = unit(rng.standard_normal((400, 16)))
    good = write_store(tmp_path / 'good', image, unit(image + 0.1 * rng.standard_normal((400, 16))))
    bad = write_store(tmp_path / 'bad', image, unit(rng.standard_normal((400, 16))))
    good_report, bad_report = check(good, batch_size=64), check(bad, batch_size=64)
    assert good_report.retrieval['image_to_text_R@1'] > 95
    assert bad_report.retrieval['image_to_text_R@1'] < 5
    assert good_report.margin['negative_fraction'] < 0.01 < bad_report.margin['negative_fraction']
    assert any('barely better than chance' in line for line in bad_report.verdict)
    assert not any('barely better than chance' in line for line in good_report.verdict)
    # a target far below such a reference: no weight is suggested for steering by it
    weak_target = check(bad, batch_size=64, clip_recall=0.1).verdict
    assert any('no weight is suggested for a reference near chance' in line for line in weak_target)
    assert not any('train with --reference-weight 1' in line for line in weak_target)
    # features all alike: every candidate ties with the pair, which retrieval counts as found (100 %), and every
    # margin is 0; that reference was advised as one to steer by
    alike = write_store(tmp_path / 'alike', np.full((400, 16), 0.25), np.full((400, 16), 0.25))
    report = check(alike, batch_size=64, clip_recall=0.1)
    assert report.retrieval['image_to_text_R@1'] == 100
    assert any(line.startswith("Its margins s_ii - s_ij are the same for every pair") for line in report.verdict)
    assert any('no weight is suggested for a reference near chance' in line for line in report.verdict)
    assert not any('train with --reference-weight 1' in line for line in report.verdict)
    assert not any(line.startswith("Its margins") for line in good_report.verdict + bad_report.verdict)
    for report in (good_report, bad_report):
        medians = [report.effective_negatives[t] for t in sorted(report.effective_negatives)]
        assert medians == sorted(medians) and 1 <= medians[0] and medians[-1] <= 63  # more spread as τ grows
        assert report.suggested_temperature == SUGGESTED_TEMPERATURE in report.effective_negatives


def test_the_verdict_suggests_the_default_start_and_warns_when_it_is_peaked(tmp_path):
    """Whatever the margins, the suggestion is drrho's default start (lower starts lost everywhere measured); the
    verdict says how its weights spread, names the τ an 'auto' start would take, and warns when even the default start
    leaves the median anchor on fewer than k effective negatives."""
    rng = np.random.default_rng(5)
    image = unit(rng.standard_normal((1000, 16)))
    store = write_store(tmp_path / 's', image, unit(image + 0.05 * rng.standard_normal((1000, 16))))
    wide = check(store, batch_size=64, reference_weight=1.0)  # a faithful reference at full weight: wide margins
    soft = check(store, batch_size=64, reference_weight=0.01)
    assert wide.effective_negatives[SUGGESTED_TEMPERATURE] < TARGET_NEGATIVES < soft.effective_negatives[
        SUGGESTED_TEMPERATURE]
    for report in (wide, soft):
        suggestion, = [line for line in report.verdict if line.startswith('Suggested:')]
        assert f"τ learned from {SUGGESTED_TEMPERATURE:g}" in suggestion
        assert f"{report.effective_negatives[SUGGESTED_TEMPERATURE]:.0f} of its 63 negatives" in suggestion
        assert f"here --temperature auto would start at τ = {report.auto_temperature:.3g}" in suggestion
    assert any(line.startswith('Even at that start') for line in wide.verdict)
    assert not any(line.startswith('Even at that start') for line in soft.verdict)


def test_the_verdict_of_a_batch_of_few_negatives_says_the_batch_is_why(tmp_path):
    """With no more negatives than the k effective ones 'auto' aims at, no τ reaches k: 'auto' stops at its bound,
    and a smaller reference weight would not help."""
    rng = np.random.default_rng(5)
    image = unit(rng.standard_normal((1000, 16)))
    store = write_store(tmp_path / 's', image, unit(image + 0.05 * rng.standard_normal((1000, 16))))
    for batch_size in (2, int(TARGET_NEGATIVES) + 1):
        report = check(store, batch_size=batch_size, reference_weight=1.0)
        negatives = batch_size - 1
        suggestion, = [line for line in report.verdict if line.startswith('Suggested:')]
        assert (f"would start at its bound τ = {report.auto_temperature:.3g}, since no τ gives an anchor with "
                f"{negatives} negatives the {TARGET_NEGATIVES:g} effective ones") in suggestion
        assert any(line.startswith(f"A batch of {batch_size} gives each anchor {negatives} negatives")
                   for line in report.verdict)
        assert not any(line.startswith('Even at that start') for line in report.verdict)
    report = check(store, batch_size=int(TARGET_NEGATIVES) + 2, reference_weight=1.0)  # the first batch that can
    assert not any(line.startswith('A batch of') for line in report.verdict)


def test_the_verdict_points_to_the_full_shift_only_below_it(tmp_path):
    rng = np.random.default_rng(6)
    image = unit(rng.standard_normal((1200, 16)))
    store = write_store(tmp_path / 's', image, unit(image + 0.3 * rng.standard_normal((1200, 16))))

    def mentions_full_shift(report):
        return any("The paper's full shift, --reference-weight 1" in line for line in report.verdict)
    report = check(store, batch_size=64)
    assert mentions_full_shift(report)
    assert mentions_full_shift(check(store, batch_size=512, reference_weight=0.5))
    assert not mentions_full_shift(check(store, batch_size=64, reference_weight=1.0))
    # the line turns the rule into this reference's number: 0.4 of the mean of its four recalls on these pairs
    mean_recall = sum(report.retrieval.values()) / 4
    assert report.mean_recall == pytest.approx(mean_recall) and 10 < mean_recall < 90
    line = next(line for line in report.verdict if line.startswith("The paper's full shift"))
    assert f"is {mean_recall:.1f}% on 1200 pairs" in line and f"stay below {0.4 * mean_recall:.1f}%." in line


def test_the_rule_s_tally_is_the_table_it_comes_from():
    """The verdict's counts and ranges are those of the evidence table in docs/defaults.md, tallied on each side of
    the fraction: a row added to the table, or a winner changed, without the verdict following fails here."""
    docs = (Path(__file__).parents[1] / 'docs' / 'defaults.md').read_text()
    header = "| setting (global batch) | `clip` ÷ reference recall | `--reference-weight 1` | default (0.25) |"
    rows = docs.split(header, 1)[1].split('\n\n', 1)[0].strip().splitlines()[1:]  # past the |---| line

    def times_clip(cell):
        return float(re.fullmatch(r'(\*\*)?([\d.]+)×(\*\*)?', cell).group(2))
    sides = {'below': [], 'above': []}
    for row in rows:
        _, ratio, full, default = [cell.strip() for cell in row.strip().strip('|').split('|')]
        side = 'below' if float(ratio) < FULL_SHIFT_MAX_TARGET_FRACTION else 'above'
        sides[side].append((float(ratio), full.startswith('**'), default.startswith('**'),
                            times_clip(full), times_clip(default)))
    assert len(rows) == sum(map(len, sides.values())) >= 29
    tallied = {}
    for side, settings in sides.items():
        # the settings where the weight the rule picks on this side (the full shift below, the default above) did
        # not have more recall
        exceptions = [ratio for ratio, full_bold, default_bold, _, _ in settings
                      if not (full_bold if side == 'below' else default_bold)]
        tallied[side] = dict(settings=len(settings), full_better=sum(s[1] for s in settings),
                             default_better=sum(s[2] for s in settings), exceptions=(min(exceptions), max(exceptions)),
                             full=(min(s[3] for s in settings), max(s[3] for s in settings)),
                             default=(min(s[4] for s in settings), max(s[4] for s in settings)))
    assert tallied == FULL_SHIFT_EVIDENCE


def test_a_clip_recall_turns_the_rule_into_a_reference_weight(tmp_path, capsys):
    rng = np.random.default_rng(6)
    image = unit(rng.standard_normal((300, 16)))
    store = write_store(tmp_path / 's', image, unit(image + 0.3 * rng.standard_normal((300, 16))))
    reference = check(store, batch_size=64).mean_recall

    def advice(clip_recall, **kwargs):
        report = check(store, batch_size=64, clip_recall=clip_recall, **kwargs)
        return next(line for line in report.verdict if line.startswith("The paper's full shift"))
    far_below = advice(0.2 * reference)
    assert "is 0.20 of it: train with --reference-weight 1." in far_below and 'stay below' not in far_below
    assert "is 0.60 of it: keep drrho's default --reference-weight 0.25." in advice(0.6 * reference)
    assert 'mostly within a spread).' in advice(0.42 * reference)
    # asked about the full shift itself, the check still says which weight the rule picks
    assert "keep drrho's default" in advice(0.6 * reference, reference_weight=1.0)
    # recall depends on the number of candidates: a sample of the store cannot be held against it
    with pytest.raises(SystemExit):
        main([str(store), '--batch-size', '64', '--samples', '100', '--clip-recall', '5'])
    assert '--samples 300' in capsys.readouterr().err
    assert main([str(store), '--batch-size', '64', '--clip-recall', '5']) == 0
    assert 'note: --clip-recall' not in capsys.readouterr().err
    # OpenCLIP logs recalls as fractions: one pasted as such is taken as given (a recall can be that low), with a note
    assert main([str(store), '--batch-size', '64', '--clip-recall', '0.25']) == 0
    assert ("--clip-recall 0.25 is read as 0.25 %; if it is the mean of OpenCLIP's logged fractions, give 25"
            in capsys.readouterr().err)


def test_larger_batches_spread_the_weights_and_lower_the_auto_temperature(tmp_path):
    rng = np.random.default_rng(2)
    image = unit(rng.standard_normal((2000, 16)))
    store = write_store(tmp_path / 's', image, unit(image + 0.8 * rng.standard_normal((2000, 16))))
    small, large = check(store, batch_size=32), check(store, batch_size=1024)
    assert large.effective_negatives[0.05] > small.effective_negatives[0.05]
    assert large.auto_temperature < small.auto_temperature


def test_reference_weight_scales_the_margins_the_weights_see(tmp_path):
    """With --reference-weight α the start-of-training weights are softmax(α·m/τ): the effective negatives at τ are
    those of α = 1 at τ/α, and the margins themselves (the reference's own) do not change."""
    rng = np.random.default_rng(4)
    image = unit(rng.standard_normal((600, 16)))
    store = write_store(tmp_path / 's', image, unit(image + 0.5 * rng.standard_normal((600, 16))))
    half = check(store, batch_size=64, temperature=0.025, reference_weight=0.5)
    full = check(store, batch_size=64, temperature=0.05, reference_weight=1.0)
    assert half.margin == full.margin and half.reference_weight == 0.5
    assert half.effective_negatives[0.025] == pytest.approx(full.effective_negatives[0.05], rel=1e-6)
    assert half.effective_negatives[0.05] > full.effective_negatives[0.05]  # a softer shift spreads the weights
    assert half.auto_temperature == pytest.approx(full.auto_temperature / 2, rel=1e-3)


def test_command_prints_the_report_and_writes_json(tmp_path, capsys):
    rng = np.random.default_rng(3)
    image = unit(rng.standard_normal((200, 8)))
    store = write_store(tmp_path / 's', image, unit(image + 0.3 * rng.standard_normal((200, 8))), dtype='float16')
    assert main([str(store), '--batch-size', '64', '--temperature', '0.01', '--json', str(tmp_path / 'r.json')]) == 0
    out = capsys.readouterr().out
    assert 'retrieval (%)' in out and "Suggested: drrho's default, τ learned from 0.07" in out
    assert 'tau 0.07      ' in out and '<- suggested: the default start' in out
    assert 'At τ = 0.01 and batch 64' in out
    saved = json.loads((tmp_path / 'r.json').read_text())
    assert saved['batch_size'] == 64 and saved['temperature'] == 0.01
    # the teacher's calibrated scale: that of the first batch of the drawn samples, what KD's 'auto' would use
    assert 1 < saved['teacher_logit_scale'] < 100
    assert f"calibrated at logit scale {saved['teacher_logit_scale']:.3g}" in out
    assert "KD helped where a --loss clip model stayed far below the reference" in out


@pytest.mark.parametrize('flags, message', [
    (['--samples', '-5'], '--samples must be at least 2 (retrieval needs candidates), not -5'),
    (['--samples', '0'], '--samples must be at least 2'),
    (['--json', 'no_such_folder/r.json'], "--json no_such_folder/r.json: no folder '"),
    (['--json', '.'], "--json . is a folder: name the file to write, e.g. check.json"),
    # a report over one of the store's files left the store unreadable, and the check said nothing
    (['--json', 's/manifest.json'], "--json s/manifest.json is in the store's folder"),
    (['--json', 's/train.features.npy'], "is in the store's folder")])
def test_command_refuses_what_it_would_misreport_or_fail_on_at_the_end(tmp_path, capsys, monkeypatch, flags, message):
    rng = np.random.default_rng(3)
    image = unit(rng.standard_normal((50, 8)))
    store = write_store(tmp_path / 's', image, image)
    monkeypatch.chdir(tmp_path)
    before = {f.name: f.read_bytes() for f in store.iterdir()}
    with pytest.raises(SystemExit):
        main([str(store), '--batch-size', '16', *flags])
    captured = capsys.readouterr()
    assert message in captured.err and 'retrieval (%)' not in captured.out
    assert {f.name: f.read_bytes() for f in store.iterdir()} == before


def test_features_command_dispatches_check(tmp_path, capsys):
    from drrho_openclip.precompute import main as features_command
    rng = np.random.default_rng(4)
    image = unit(rng.standard_normal((50, 8)))
    store = write_store(tmp_path / 's', image, image)
    assert features_command(['check', str(store), '--batch-size', '16']) == 0
    assert 'image_to_text_R@1 100.0' in capsys.readouterr().out


def test_keys_only_store_is_refused_by_name(tmp_path, capsys):
    writer = FeatureStoreWriter(tmp_path / 'keys', None, None, dtype=None)
    writer.add_shard('part', ['a', 'b', 'c'])
    writer.close()
    assert main([str(tmp_path / 'keys'), '--batch-size', '4']) == 1
    assert f"'{tmp_path / 'keys'}' is a keys-only store" in capsys.readouterr().out
    assert main([str(tmp_path / 'missing'), '--batch-size', '4']) == 1
    assert 'does not exist' in capsys.readouterr().out
    assert main([str(tmp_path / 'keys' / 'manifest.json'), '--batch-size', '4']) == 1  # it does: it is no folder
    assert (f"'{tmp_path / 'keys' / 'manifest.json'}' is a file; a reference-feature store is a folder: pass the "
            f"folder that holds manifest.json") in capsys.readouterr().out
    (tmp_path / 'missing.partial').mkdir()  # a store being written: every reader says so (verify alone did)
    assert main([str(tmp_path / 'missing'), '--batch-size', '4']) == 1
    assert f"('{tmp_path / 'missing.partial'}' holds an unfinished one: run precompute again" in capsys.readouterr().out


def test_the_readme_s_example_report_is_what_the_check_prints(tmp_path, capsys):
    """The README's example output is an excerpt typed into it: each of its lines of the table and each sentence of
    its verdict must be what the check prints, up to the numbers (its own run was on the demo's store)."""
    readme = (Path(__file__).parents[1] / 'README.md').read_text()
    example = readme.split("For example, on the demo's store", 1)[1].split('\n### ', 1)[0]
    block = [line[4:] for line in example.splitlines() if line.startswith('    ')]
    verdict_at = block.index('verdict:')

    def masked(text):  # numbers out, whitespace (the README's wrapping) to single spaces
        return ' '.join(re.sub(r'\d+(\.\d+)?', '#', text).split())

    rng = np.random.default_rng(0)
    image = unit(rng.standard_normal((2048, 16)))  # a reference that finds about a tenth of its pairs first
    store = write_store(tmp_path / 's', image, unit(image + 0.6 * rng.standard_normal((2048, 16))))
    assert main([str(store), '--batch-size', '64', '--temperature', '0.01']) == 0
    printed = capsys.readouterr().out
    table = [masked(line) for line in printed.split('verdict:', 1)[0].splitlines()]
    verdict = masked(printed.split('verdict:', 1)[1])
    for line in block[:verdict_at]:
        assert masked(line) in table, line
    sentences = re.split(r'(?<=[.)])\s+(?=[A-Z])', ' '.join(block[verdict_at + 1:]))
    assert len(sentences) >= 5
    for sentence in sentences:
        assert masked(sentence) in verdict, sentence
