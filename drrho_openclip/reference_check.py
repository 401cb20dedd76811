"""`drrho-openclip-features check STORE`: is this reference model good enough to steer training on this data?

Reads a feature store (of the training data, a slice of it, or validation data precomputed the same way) and
reports, before any GPU-day is spent:

- the reference's own image↔text retrieval among the store's samples (R@1, R@5 in both directions): a reference
  that cannot find a sample's own caption has little to teach;
- the spread of the reference margin m_ij = s^ref_ii − s^ref_ij over the negatives of training-sized batches
  (negative margins: pairs the reference ranks above the positive, i.e. noisy or duplicated captions);
- how peaked DRRho's weights are at a temperature τ and the global batch B. At the start of training the learner's
  similarities carry no information, so the RHO-shifted loss is ℓ̂_ij ≈ α·m_ij (α: drrho's --reference-weight) and
  the KL-DRO weights of an anchor are softmax_j(α·m_ij/τ) over its B − 1 negatives; their effective number
  exp(entropy) says over how many negatives each anchor's gradient is spread: near 1, one negative per anchor carries
  the whole update;
- a verdict in plain words: the τ to train with (drrho's default start, see `SUGGESTED_TEMPERATURE`) and how its
  weights spread on such batches, the τ that `--temperature auto` would start from (the τ whose median anchor has k
  effective negatives), the logit scale at which the reference is a calibrated teacher on such a batch (what
  `--reference-logit-scale auto` uses for distillation), and which reference weight to train with: given a
  `--loss clip` model's mean recall on the same pairs (`--clip-recall`), the weight the evidence's rule picks for it,
  else the recall below which the paper's full shift did better.
"""
import argparse
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List

import torch

from .features import FeatureStore, FeatureStoreError, write_json
from .losses import effective_negatives, get_loss_spec, reference_margins, temperature_for_effective_negatives
from .losses.distill import calibrated_logit_scale

DEFAULT_SAMPLES = 5000  # the pairs retrieval is measured among, unless --samples or --clip-recall says otherwise
TEMPERATURES = (0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.2)
# Anchors per direction whose margins each batch contributes, over all B − 1 negatives: up to 256 (8 batches give
# 4096 rows), fewer in large batches so that a batch's rows hold about 2^23 margins (at B = 32768, 128 anchors and
# 0.5 GiB of float64 over 8 batches: every anchor of a batch that large would take 17 GiB)
MAX_BATCH_ANCHORS = 256
MARGINS_PER_BATCH = 1 << 23
# Rows of margins a pass over them reads at once (the weights' softmax per τ), and the margins the bisection of
# --temperature auto's τ reads some 40 times
ROWS_PER_PASS = 256
AUTO_TEMPERATURE_MARGINS = 1 << 24
DRRHO_DEFAULTS = get_loss_spec('drrho').defaults
# drrho's 'auto' τ starts where the median anchor has this many effective negatives, within its τ bounds; fewer than
# this at the suggested τ earns the verdict a warning
TARGET_NEGATIVES = DRRHO_DEFAULTS['target_negatives']
# The τ suggested, whatever the margins: drrho's default start, learned from there. A rule from the margins (the
# smallest τ whose median anchor starts on at least TARGET_NEGATIVES effective negatives, as --temperature auto) gives
# 0.0035-0.022 on the evidence's references at the default α, and the starts from 0.0035 to 0.035 lost to the
# 0.07 start in all 14 cells measured, and to --loss clip in 13 (docs/defaults.md, "Temperature").
SUGGESTED_TEMPERATURE = DRRHO_DEFAULTS['temperature']
# Below this spread of the margins, a reference's features are taken as all alike (float32 features: their
# products differ in the 7th digit)
FLAT_MARGIN_STD = 1e-5
# The full shift (α = 1) beat the default α on the mean where a `clip` target's recall stayed below this fraction of
# the reference's, and mostly lost where it reached it; all of them small runs: the paper's own at 10^8-10^9 samples
# seen do not follow it (README)
FULL_SHIFT_MAX_TARGET_FRACTION = 0.4
# ... and the settings within about this distance of it (0.39 to 0.46) were mostly within a spread either way
FULL_SHIFT_TIE_BAND = 0.05
# The settings behind the rule: the table of docs/defaults.md ("When to use the paper's full shift") tallied on each
# side of the fraction (a test tallies it again): how many, in how many each weight had more mean recall on the mean
# (neither where level), where the exceptions lie, and each weight's range of mean recall as a multiple of `clip`'s
FULL_SHIFT_EVIDENCE = {
    'below': dict(settings=13, full_better=11, default_better=0, exceptions=(0.20, 0.27),
                  full=(0.94, 2.15), default=(0.81, 1.85)),
    'above': dict(settings=16, full_better=2, default_better=12, exceptions=(0.40, 0.52),
                  full=(0.64, 1.35), default=(0.92, 1.56)),
}


@dataclass
class ReferenceReport:
    store: str
    samples: int                      # samples the retrieval was measured among
    batch_size: int                   # of the batches the margins and weights are from: the one asked, or the store's
    batch_size_asked: int             # size where the store holds fewer samples
    retrieval: Dict[str, float]       # R@1 / R@5, image→text and text→image, in %
    mean_recall: float                # their mean, the evidence's measure of retrieval
    margin: Dict[str, float]          # mean, std, quantiles of m_ij, fraction of negative margins
    effective_negatives: Dict[float, float] = field(default_factory=dict)  # τ → median over anchors
    temperature: float = None         # the τ asked about
    reference_weight: float = DRRHO_DEFAULTS['reference_weight']  # α of the shift the weights are computed for
    suggested_temperature: float = SUGGESTED_TEMPERATURE
    auto_temperature: float = None    # where drrho's --temperature auto starts on such batches
    teacher_logit_scale: float = None  # the reference's calibrated logit scale on a batch of batch_size
    clip_recall: float = None         # a --loss clip model's mean recall on the same pairs, when given
    verdict: List[str] = field(default_factory=list)


def _sample(store: FeatureStore, count: int, generator: torch.Generator):
    """(image, text) features of `count` distinct random samples of the store, in store order, float64."""
    index = torch.randperm(store.num_samples, generator=generator)[:count].sort().values
    image, text = store.batch_features(index)
    return image.double(), text.double()


def retrieval_ranks(image: torch.Tensor, text: torch.Tensor, chunk: int = 1024) -> Dict[str, torch.Tensor]:
    """Per sample and direction, how many candidates score above its own caption (image), ties not counted (in
    chunks of anchors: memory O(chunk · n), not n²). A candidate with the very features of the sample's own (the same
    caption or image again) ties with it: the product rounds identical columns differently by their place, which
    ranked such copies above it. A sample whose own score is not a number is ranked below every candidate."""
    out = {}
    for direction, anchors, candidates in (('image_to_text', image, text), ('text_to_image', text, image)):
        copies = torch.unique(candidates, dim=0, return_inverse=True)[1]  # equal feature rows, one id
        ranks = []
        for start in range(0, len(anchors), chunk):
            sim = anchors[start:start + chunk] @ candidates.T
            rows = torch.arange(start, min(start + chunk, len(anchors)), device=sim.device)
            positive = sim[:, start:start + chunk].diagonal()  # from the same product: rounded alike
            above = (sim > positive[:, None]) & (copies[None, :] != copies[rows][:, None])
            ranks.append(torch.where(positive.isnan(), len(candidates), above.sum(dim=1)))
        out[direction] = torch.cat(ranks)
    return out


def retrieval(image: torch.Tensor, text: torch.Tensor, chunk: int = 1024) -> Dict[str, float]:
    """R@1 and R@5 (%) of each sample's own caption among all texts, and of its own image among all images."""
    return {f'{direction}_R@{k}': 100 * (rank < k).double().mean().item()
            for direction, rank in retrieval_ranks(image, text, chunk).items() for k in (1, 5)}


def random_batches(store: FeatureStore, batch_size: int, batches: int, seed: int):
    """`batches` random batches of `batch_size` distinct samples of the whole store: [(image, text)], float64."""
    g = torch.Generator().manual_seed(seed + 1)
    return [_sample(store, batch_size, g) for _ in range(batches)]


def batch_margins(batches, max_anchors: int = None) -> torch.Tensor:
    """[Σ 2·r, B − 1] margins s_ii − s_ij over the B − 1 negatives of the first r = min(B, max_anchors) anchors of
    each (image, text) batch, both directions (a batch's order is random: its first anchors are a random sample).
    `max_anchors` None: MAX_BATCH_ANCHORS, fewer where a batch's rows would hold more than MARGINS_PER_BATCH."""
    if max_anchors is None:
        size = batches[0][0].shape[0]
        max_anchors = min(MAX_BATCH_ANCHORS, max(16, MARGINS_PER_BATCH // (2 * size)))
    return torch.cat([reference_margins(image, text, max_anchors) for image, text in batches])


def median_effective_negatives(margins: torch.Tensor, tau: float) -> float:
    """The median over anchors (rows) of `effective_negatives`, a few rows at a time."""
    return torch.cat([effective_negatives(rows, tau) for rows in margins.split(ROWS_PER_PASS)]).median().item()


def auto_temperature(margins: torch.Tensor, reference_weight: float = 1.0, max_anchors: int = 4096) -> float:
    """The τ drrho's --temperature auto starts from, for the anchors of `margins` shifted by α = `reference_weight`
    (evenly thinned to `max_anchors` rows, or fewer that hold AUTO_TEMPERATURE_MARGINS: a bisection reads them some
    40 times)."""
    max_anchors = min(max_anchors, max(64, AUTO_TEMPERATURE_MARGINS // margins.shape[1]))
    rows = reference_weight * margins[::max(1, len(margins) // max_anchors)]
    return temperature_for_effective_negatives(rows, TARGET_NEGATIVES, DRRHO_DEFAULTS['tau_min'],
                                               DRRHO_DEFAULTS['tau_max']).item()


class FlagConflict(ValueError):
    """Flags that cannot be honoured together for this store: main() reports it as a usage error."""


def check(store_dir, batch_size: int, temperature: float = None, samples: int = None, batches: int = 8,
          seed: int = 0, reference_weight: float = DRRHO_DEFAULTS['reference_weight'],
          clip_recall: float = None) -> ReferenceReport:
    store = FeatureStore.open(store_dir)
    if store.keys_only:
        raise FeatureStoreError(f"'{store.root}' is a keys-only store: it holds no reference features to check")
    if store.num_samples < 2:
        raise FeatureStoreError(f"'{store.root}' holds {store.num_samples} samples: at least 2 are needed")
    # recall falls as the candidates grow: a clip model's recall compares with the reference's over the same pairs
    count = min(samples or (store.num_samples if clip_recall is not None else DEFAULT_SAMPLES), store.num_samples)
    if clip_recall is not None and count < store.num_samples:
        raise FlagConflict(f"--clip-recall is compared with the reference's recall over the same pairs, and "
                           f"'{store.root}' holds {store.num_samples}: give --samples {store.num_samples} (or more), "
                           f"or leave --samples out")
    image, text = _sample(store, count, torch.Generator().manual_seed(seed))
    recalls = retrieval(image, text)
    batch = min(batch_size, store.num_samples)
    drawn = random_batches(store, batch, batches, seed)
    margins = batch_margins(drawn)
    quantiles = torch.quantile(margins.flatten()[:1 << 24].float(), torch.tensor([0.05, 0.5, 0.95])).tolist()
    grid = sorted(set(TEMPERATURES) | {SUGGESTED_TEMPERATURE} | ({temperature} if temperature else set()))
    # the loss's weights at the start of training see α·m/τ: the margins at τ/α
    medians = {tau: median_effective_negatives(margins, tau / reference_weight) for tau in grid}
    report = ReferenceReport(
        store=str(store.root), samples=count, batch_size=batch, batch_size_asked=batch_size, retrieval=recalls,
        mean_recall=sum(recalls.values()) / len(recalls),
        margin=dict(mean=margins.mean().item(), std=margins.std().item(), q05=quantiles[0], median=quantiles[1],
                    q95=quantiles[2], negative_fraction=(margins < 0).double().mean().item()),
        effective_negatives=medians, temperature=temperature, reference_weight=reference_weight,
        auto_temperature=auto_temperature(margins, reference_weight),
        teacher_logit_scale=calibrated_logit_scale(*drawn[0]).item(), clip_recall=clip_recall)
    report.verdict = verdict(report)
    return report


def verdict(r: ReferenceReport) -> List[str]:
    chance = 100 / r.samples
    r1 = (r.retrieval['image_to_text_R@1'] + r.retrieval['text_to_image_R@1']) / 2
    lines = [f"The reference finds a sample's own pair first for {r1:.1f}% of {r.samples} samples "
             f"(chance {chance:.2g}%)."]
    # retrieval counts a candidate that ties with the pair as found (identical captions are one caption): features
    # all alike tie everywhere and score 100 %, so margins that do not vary say more than recall
    flat = r.margin['std'] < FLAT_MARGIN_STD
    near_chance = r1 < 10 * chance or flat
    if flat:
        lines.append(f"Its margins s_ii - s_ij are the same for every pair (std {r.margin['std']:.1g}): its features do "
                     f"not tell these pairs apart, whatever the recall above (ties count as found), and steering by "
                     f"it does nothing; check that the store belongs to this data and this reference.")
    elif near_chance:
        lines.append("It is barely better than chance on this data: its features say little about these pairs, so "
                     "steering by it cannot help much; check that the store belongs to this data and this reference.")
    if r.margin['negative_fraction'] > 0.25:
        lines.append(f"{100 * r.margin['negative_fraction']:.0f}% of negatives score above their positive for the "
                     f"reference: many pairs look noisy or duplicated to it, and DRRho will down-weight them.")
    negatives = r.batch_size - 1
    if r.batch_size < r.batch_size_asked:
        lines.append(f"The store holds {r.batch_size} samples, fewer than a batch of {r.batch_size_asked}: the margins "
                     f"and weights below are those of batches of {r.batch_size}; at a given τ the weights spread "
                     f"over more negatives in a larger batch. Check a store of at least {r.batch_size_asked} samples "
                     f"(a slice of the training data) for the planned batch.")
    if r.temperature is not None:
        n = r.effective_negatives[r.temperature]
        lines.append(f"At τ = {r.temperature:g} and batch {r.batch_size}, each anchor's update rests on about "
                     f"{n:.1f} of its {negatives} negatives at the start of training.")
    s = r.suggested_temperature
    few_negatives = negatives <= TARGET_NEGATIVES  # no τ puts an anchor on TARGET_NEGATIVES effective negatives
    auto = (f"here --temperature auto would start at its bound τ = {r.auto_temperature:.3g}, since no τ gives an "
            f"anchor with {negatives} negatives the {TARGET_NEGATIVES:g} effective ones it aims at" if few_negatives
            else f"here --temperature auto would start at τ = {r.auto_temperature:.3g} (the smallest τ whose median "
                 f"anchor starts on at least {TARGET_NEGATIVES:g} effective negatives)")
    lines.append(f"Suggested: drrho's default, τ learned from {s:g} as the model's logit_scale; at batch "
                 f"{r.batch_size} and reference weight {r.reference_weight:g} it starts each anchor's update on about "
                 f"{r.effective_negatives[s]:.0f} of its {negatives} negatives. Lower starts (0.0035 to 0.035, "
                 f"--temperature auto's among them, learned by the loss's own Adam) lost to 0.07 in all 14 real-data "
                 f"cells measured, and to --loss clip in 13; with --temperature-optimizer loss, {auto}.")
    if few_negatives:
        lines.append(f"A batch of {r.batch_size} gives each anchor {negatives} negatives, no more than the "
                     f"{TARGET_NEGATIVES:g} effective ones drrho's --rho auto keeps: ρ is 0 there, and a learned τ "
                     f"rises, weighting the negatives about evenly. Batches of "
                     f"{int(TARGET_NEGATIVES) + 2} or more are where ρ and τ steer the weights.")
    elif r.effective_negatives[s] < TARGET_NEGATIVES:
        lines.append(f"Even at that start each anchor's update rests on fewer than {TARGET_NEGATIVES:g} negatives: "
                     f"this reference's margins are wide at this weight, and a smaller --reference-weight spreads "
                     f"the weights (they see α·m/τ); the full shift, which concentrates them most, lost to the "
                     f"default at batch 64.")
    if r.reference_weight < 1 or r.clip_recall is not None:
        fraction = FULL_SHIFT_MAX_TARGET_FRACTION
        below, above = FULL_SHIFT_EVIDENCE['below'], FULL_SHIFT_EVIDENCE['above']
        rule = (f"The paper's full shift, --reference-weight 1, did better on the mean than the default 0.25 in "
                f"{below['full_better']} of the {below['settings']} evidence settings where a --loss clip model's "
                f"mean recall stayed below {fraction:g} of the reference's on the same held-out pairs "
                f"({_span(below['full'])}x its mean recall against {_span(below['default'])}x; level in the other "
                f"{below['settings'] - below['full_better']}, at {_span(below['exceptions'])}), and worse in "
                f"{above['default_better']} of the {above['settings']} where it reached that or more (the other "
                f"{above['settings'] - above['default_better']}, at {_span(above['exceptions'])}, better or level; "
                f"near {fraction:g} mostly within a spread). Those runs saw up to 5e5 "
                f"samples; at the paper's 3e8-1.3e9 its targets ended at 0.8-1.3 of their references' accuracy and "
                f"the full shift still beat the reference-free FastCLIP, so there the rule does not hold as measured "
                f"here. Here the reference's mean recall (of its R@1 and R@5 both ways) is {r.mean_recall:.1f}% on "
                f"{r.samples} pairs")
        if r.clip_recall is None:
            lines.append(f"{rule}: use the full shift when the model you train, trained with --loss clip and "
                         f"evaluated on the same pairs (OpenCLIP's --val-data reports the same four recalls; "
                         f"--clip-recall gives it to this check), would stay below {fraction * r.mean_recall:.1f}%.")
        else:
            ratio = r.clip_recall / r.mean_recall if r.mean_recall else float('inf')  # a reference that finds none
            advice = ("no weight is suggested for a reference near chance (above)" if near_chance else
                      "train with --reference-weight 1" if ratio < fraction else
                      f"keep drrho's default --reference-weight {DRRHO_DEFAULTS['reference_weight']:g}")
            lines.append(f"{rule}, and the --loss clip model's {r.clip_recall:.1f}% is {ratio:.2f} of it: {advice}"
                         + (" (near the bound the two were mostly within a spread)."
                            if abs(ratio - fraction) < FULL_SHIFT_TIE_BAND else "."))
    lines.append(f"As a distillation teacher (--distill-weight) it is calibrated at logit scale "
                 f"{r.teacher_logit_scale:.3g} on such a batch, which --reference-logit-scale auto finds on the first "
                 f"batch; a scale far above it would teach the reference's mistakes as certainties. In the evidence, "
                 f"KD helped where a --loss clip model stayed far below the reference over many epochs on the same "
                 f"data (zero-shot in all 3 such settings, recall in 2, with drrho's KD at a quarter of the weight "
                 f"--distill-weight 0.5 gives it today; at 0.5, 1.19x clip's recall at 8 seeds in one of them), and "
                 f"cost at batches of 512 and more over 48 steps, more at 0.5 than at that quarter (recall at batch "
                 f"2048, zero-shot at 512): a short run wants it off.")
    return lines


def _span(bounds) -> str:
    return f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def format_report(r: ReferenceReport) -> str:
    marks = {r.suggested_temperature: '   <- suggested: the default start'}
    out = [f"{r.store}: retrieval among {r.samples} samples, batches of {r.batch_size}"
           + (f" (the store's size; {r.batch_size_asked} asked)" if r.batch_size < r.batch_size_asked else ""),
           "retrieval (%): " + ', '.join(f"{k} {v:.1f}" for k, v in r.retrieval.items())
           + f"; mean recall {r.mean_recall:.1f}",
           "reference margin s_ii - s_ij: " + ', '.join(f"{k} {v:.3f}" for k, v in r.margin.items()),
           f"effective negatives per anchor at the start (median, of {r.batch_size - 1}; reference weight "
           f"{r.reference_weight:g}):",
           *(f"  tau {tau:<6g} {n:8.1f}{marks.get(tau, '')}" for tau, n in r.effective_negatives.items()),
           "verdict:", *(f"  {line}" for line in r.verdict)]
    return '\n'.join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog='drrho-openclip-features check', allow_abbrev=False,
                                description=__doc__.split('\n')[0])
    p.add_argument('store', help='a feature store (of the training data, or of validation data)')
    p.add_argument('--batch-size', type=int, required=True, help='the global batch size of the planned training')
    p.add_argument('--temperature', type=float, default=None, help='also report this τ')
    p.add_argument('--samples', type=int, default=None,
                   help=f'samples to measure retrieval among (default: {DEFAULT_SAMPLES}, or with --clip-recall all '
                        f'of the store\'s); the batches are drawn from the whole store')
    p.add_argument('--reference-weight', type=float, default=DRRHO_DEFAULTS['reference_weight'],
                   help="drrho's --reference-weight α: the weights are those of α·m/τ (default: %(default)s)")
    p.add_argument('--clip-recall', type=float, default=None,
                   help="a --loss clip model's mean recall on the pairs of this store, in %%: 100 × the mean of "
                        "image_to_text_R@1, image_to_text_R@5, text_to_image_R@1 and text_to_image_R@5, which "
                        "OpenCLIP's --val-data logs as fractions; the verdict then says which --reference-weight to "
                        "train with")
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--json', default=None, help='also write the report to this file')
    args = p.parse_args(argv)
    if args.batch_size < 2:
        p.error('--batch-size must be at least 2')
    if args.samples is not None and args.samples < 2:
        p.error(f'--samples must be at least 2 (retrieval needs candidates), not {args.samples}')
    if args.json and not Path(args.json).resolve().parent.is_dir():  # before a check that may take minutes
        p.error(f"--json {args.json}: no folder '{Path(args.json).resolve().parent}' to write it in")
    if args.json and Path(args.json).is_dir():
        p.error(f"--json {args.json} is a folder: name the file to write, e.g. {Path(args.json) / 'check.json'}")
    if args.json and Path(args.store).resolve() in Path(args.json).resolve().parents:
        p.error(f"--json {args.json} is in the store's folder, whose files are the store's (its manifest, its "
                f"shards): write the report outside it")
    if args.temperature is not None and not args.temperature > 0:
        p.error('--temperature must be > 0')
    if not args.reference_weight > 0:
        p.error('--reference-weight must be > 0 (at 0 the reference does not steer the weights)')
    if args.clip_recall is not None and not 0 <= args.clip_recall <= 100:
        p.error(f'--clip-recall is a percentage, got {args.clip_recall}')
    if args.clip_recall is not None and 0 < args.clip_recall < 1:  # OpenCLIP logs recalls as fractions
        print(f"note: --clip-recall {args.clip_recall:g} is read as {args.clip_recall:g} %; if it is the mean of "
              f"OpenCLIP's logged fractions, give {100 * args.clip_recall:g}", file=sys.stderr)
    try:
        report = check(args.store, args.batch_size, args.temperature, args.samples, seed=args.seed,
                       reference_weight=args.reference_weight, clip_recall=args.clip_recall)
    except FeatureStoreError as e:
        print(f"PROBLEM: {e}")
        return 1
    except FlagConflict as e:
        p.error(str(e))
    print(format_report(report))
    if args.json:
        write_json(args.json, asdict(report))
    return 0


if __name__ == '__main__':
    sys.exit(main())
