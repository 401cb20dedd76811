"""drrho with CLIP's estimator and scale (its default since 2026-12-01: γ = 1, ε = 1/(B − 1), τ the model's
logit_scale) against the default before it (SogCLR's u with γ = 0.8, ε = 1e-4, τ learned by the loss's own Adam),
both at α = 0.25 with the column step, paired seed by seed in every evidence setting where both ran, with each
setting's `clip`: benchmarks/results/evidence/clip_estimator.md, the README's table.

    python benchmarks/clip_estimator_summary.py

The runs gave ε as a number, 1/(B − 1) at their global batch B, but the batch-8192 cell, run with
`--positive-in-denominator`; the former default is `drrho --column-step` in folders run before the column step became
the default, `drrho` after. Rows as column_step_summary.py's CELLS.
"""
from column_step_summary import EVIDENCE, table


def clip_like(epsilon):
    return f'drrho --gamma 1 --epsilon {epsilon} --temperature-optimizer model'


CELLS = [
    ('Fashion-MNIST, 64, CLIP ref., 192 steps',
     'fashion-mnist_batch64_dro_as_softmax_column_step_8seeds', clip_like('0.0159'),
     'fashion-mnist_batch64_dro_as_softmax_column_step_8seeds', 'drrho',
     'fashion-mnist_batch64_8seeds', (1, 0.5)),
    ('openclipart, 64, CLIP ref., 192 steps',
     'openclipart_batch64_dro_as_softmax_column_step_deduplicated', clip_like('0.0159'),
     'openclipart_batch64_column_step_deduplicated', 'drrho --column-step',
     'openclipart_batch64_defaults_deduplicated', (1, 0.5)),
    ('openclipart, 64, CLIP ref., 720 steps',
     'openclipart_batch64_720steps_dro_as_softmax_column_step_8seeds_deduplicated', clip_like('0.0159'),
     'openclipart_batch64_720steps_column_step_deduplicated+openclipart_batch64_720steps_column_step_seeds3to7_deduplicated', 'drrho --column-step',
     'openclipart_batch64_720steps_reference_weight_deduplicated+openclipart_batch64_720steps_column_step_seeds3to7_deduplicated', (1,)),
    ('openclipart, 64, pretrained ref., 720 steps (1536 pairs)',
     'openclipart_batch64_720steps_pretrained_reference_dro_as_softmax_column_step_8seeds_deduplicated', clip_like('0.0159'),
     'openclipart_batch64_720steps_pretrained_reference_column_step_8seeds_deduplicated', 'drrho --column-step',
     'openclipart_batch64_720steps_pretrained_reference_8seeds_deduplicated', (1,)),
    ('openclipart, 64, pretrained ref., 720 steps (512 pairs)',
     'openclipart_batch64_512pairs_720steps_pretrained_reference_dro_as_softmax_column_step_8seeds_deduplicated', clip_like('0.0159'),
     'openclipart_batch64_512pairs_720steps_pretrained_reference_column_step_8seeds_deduplicated', 'drrho --column-step',
     'openclipart_batch64_512pairs_720steps_pretrained_reference_8seeds_deduplicated', (1,)),
    ('openclipart, 64, pretrained ref., 720 steps (4608 pairs)',
     'openclipart_batch64_4608pairs_pretrained_reference_dro_as_softmax_column_step_8seeds_deduplicated', clip_like('0.0159'),
     'openclipart_batch64_4608pairs_pretrained_reference_column_step_8seeds_deduplicated', 'drrho --column-step',
     'openclipart_batch64_4608pairs_pretrained_reference_8seeds_deduplicated', (1,)),
    ('drawn shapes, 128, weak ref., 128 steps',
     'shapes_batch128_dro_as_softmax_column_step', clip_like('0.00787'),
     'shapes_batch128_dro_as_softmax_column_step', 'drrho',
     'shapes_batch128_dro_as_softmax_column_step', (1,)),
    ('openclipart, 256, pretrained ref., 48 steps',
     'openclipart_batch256_pretrained_reference_dro_as_softmax_column_step_8seeds_deduplicated', clip_like('0.00392'),
     'openclipart_batch256_pretrained_reference_column_step_8seeds_deduplicated', 'drrho --column-step',
     'openclipart_batch256_pretrained_reference_8seeds_deduplicated', (1,)),
    ('Fashion-MNIST, 512, CLIP ref., 48 steps',
     'fashion-mnist_batch512_dro_as_softmax_column_step', clip_like('0.00196'),
     'fashion-mnist_batch512_defaults_column_step', 'drrho',
     'fashion-mnist_batch512_defaults', (1,)),
    ('Fashion-MNIST, 512, pretrained ref., 48 steps',
     'fashion-mnist_batch512_pretrained_reference_dro_as_softmax_column_step', clip_like('0.00196'),
     'fashion-mnist_batch512_pretrained_reference_column_step', 'drrho --column-step',
     'fashion-mnist_batch512_pretrained_reference_balanced_shift', (1,)),
    ('openclipart, 512, CLIP ref., 48 steps',
     'openclipart_batch512_dro_as_softmax_column_step_deduplicated', clip_like('0.00196'),
     'openclipart_batch512_column_step_deduplicated', 'drrho --column-step',
     'openclipart_batch512_reference_weight_deduplicated', (1,)),
    ('openclipart, 512, pretrained ref., 48 steps',
     'openclipart_batch512_pretrained_reference_dro_as_softmax_column_step_deduplicated', clip_like('0.00196'),
     'openclipart_batch512_pretrained_reference_defaults_column_step_deduplicated', 'drrho',
     'openclipart_batch512_pretrained_reference_defaults_deduplicated', (1, 0.5)),
    ('openclipart, 512, pretrained ref., 192 steps',
     'openclipart_batch512_pretrained_reference_192steps_dro_as_softmax_column_step_deduplicated', clip_like('0.00196'),
     'openclipart_batch512_pretrained_reference_192steps_column_step_deduplicated', 'drrho --column-step',
     'openclipart_batch512_pretrained_reference_192steps_deduplicated', (1,)),
    ('Fashion-MNIST, 2048, CLIP ref., 64 steps',
     'fashion-mnist_batch2048_dro_as_softmax_column_step', clip_like('0.000489'),
     'fashion-mnist_batch2048_column_step', 'drrho --column-step',
     'fashion-mnist_batch2048_balanced', (1,)),
    ('openclipart, 2048, pretrained ref., 48 steps',
     'openclipart_batch2048_pretrained_reference_dro_as_softmax_column_step_deduplicated', clip_like('0.000489'),
     'openclipart_batch2048_pretrained_reference_defaults_column_step_deduplicated', 'drrho',
     'openclipart_batch2048_pretrained_reference_defaults_deduplicated', (1,)),
    ('Fashion-MNIST, 4096, CLIP ref., 64 steps',
     'fashion-mnist_batch4096_dro_as_softmax_column_step', clip_like('0.000244'),
     'fashion-mnist_batch4096_column_step', 'drrho',
     'fashion-mnist_batch4096', (1,)),
    ("Fashion-MNIST, 8192, CLIP ref., 64 steps; `clip`'s recall scored with ties ranked as before",
     'fashion-mnist_batch8192_dro_as_softmax_column_step',
     'drrho --gamma 1 --positive-in-denominator --temperature-optimizer model',
     'fashion-mnist_batch8192_column_step', 'drrho',
     'fashion-mnist_batch8192', (1,)),
]


def main():
    lines = table(CELLS, "former default (u, γ 0.8, ε 1e-4, τ by the loss's Adam)",
                  "default (γ 1, ε 1/(B − 1), τ the model's)")
    out = EVIDENCE / 'clip_estimator.md'
    out.write_text("# drrho with CLIP's estimator and scale against its former default\n\nBoth at α = 0.25 with the "
                   "column step. Cells: zero-shot top-1 / mean recall (%), mean ± std over the seeds, ×`clip`'s mean "
                   "recall; Δ: new − former, mean ± standard error.\n\n" + '\n'.join(lines) + '\n')
    print(out.read_text())


if __name__ == '__main__':
    main()
