"""The loss diagnostics reach OpenCLIP's TensorBoard log under its train/ prefix: a real run, its real event file."""
from conftest import run_openclip, train_args
from drrho_openclip.demo import tensorboard_scalars

# what a user watches to understand a DRRho run: the objective, τ, the SogCLR estimators, γ and how much of the
# data they cover, how many negatives carry each anchor's update, and how far the reference separates the pairs
DRRHO_TAGS = {'train/objective', 'train/tau_image_mean', 'train/tau_text_mean', 'train/log_u_image_mean',
              'train/log_u_text_mean', 'train/gamma', 'train/state_coverage', 'train/effective_negatives',
              'train/reference_margin', 'train/contrastive_loss', 'train/loss'}


def scalars(run_dir) -> dict:
    """{tag: [value per logged step]} of a run's real TensorBoard event file."""
    return {tag: list(values) for tag, (_, values) in tensorboard_scalars(run_dir).items()}


def test_drrho_diagnostics_reach_tensorboard(shapes, tmp_path):
    run_openclip(train_args(shapes, tmp_path, 'tb', '--loss', 'drrho', '--ref-features', shapes['ref'],
                            '--gamma', '0.5', '--report-to', 'tensorboard', '--log-every-n-steps', '1', epochs=2))
    logged = scalars(tmp_path / 'tb')
    assert DRRHO_TAGS <= set(logged), sorted(DRRHO_TAGS - set(logged))
    steps = len(logged['train/loss'])
    assert steps == 2 * 64 // 8  # every step of both epochs
    for tag in DRRHO_TAGS:
        assert len(logged[tag]) == steps, tag
    # values a user can read: 1 ≤ effective negatives ≤ B − 1, the state covers more data as training goes on, γ is
    # 1 in epoch 0 and then moves towards --gamma
    assert all(1 <= n <= 7 for n in logged['train/effective_negatives'])
    assert logged['train/state_coverage'][-1] > logged['train/state_coverage'][0]
    assert logged['train/gamma'][0] == 1 and logged['train/gamma'][-1] < 1


def test_clip_logs_no_plugin_diagnostics(shapes, tmp_path):
    run_openclip(train_args(shapes, tmp_path, 'clip', '--report-to', 'tensorboard', '--log-every-n-steps', '1'))
    logged = scalars(tmp_path / 'clip')
    plugin_only = DRRHO_TAGS - {'train/contrastive_loss', 'train/loss'}
    assert 'train/contrastive_loss' in logged
    assert not plugin_only & set(logged)
