"""ADNCE's re-weighting of the negatives (Wu et al., 2023; adnce.md), as the core's `negative_log_weight`.

Each negative j of anchor i gets the detached Gaussian weight w_ij = exp(−(s_ij − µ)²/(2σ²)) of its raw cosine
similarity s_ij (not of s/τ, nor of exp(s/τ): the published pseudocode's slip), normalised to mean 1 over the
anchor's negatives, so the row's mean over j ≠ i becomes mean_j w̄_ij exp(ℓ̂_ij/τ). Per row, in both directions,
over the global negatives; in log space, so τ = 0.01 does not overflow.
"""
from .tiled import RowNormalizedLogWeight


class GaussianLogWeight:
    """log w_ij = −(s_ij − µ)² / (2σ²), elementwise (so the tiled aggregation can stream it)."""

    def __init__(self, mu: float, sigma: float):
        if sigma <= 0:
            raise ValueError(f"ADNCE's σ must be > 0, got {sigma}")
        self.mu, self.sigma = mu, sigma

    def __call__(self, sim, positive_mask):
        return -0.5 * ((sim - self.mu) / self.sigma) ** 2

    def __repr__(self):
        return f'{type(self).__name__}(mu={self.mu}, sigma={self.sigma})'


def adnce_log_weight(mu: float, sigma: float) -> RowNormalizedLogWeight:
    """The core's `negative_log_weight` for ADNCE: log w̄_ij = log w_ij − log mean_{k≠i} w_ik."""
    return RowNormalizedLogWeight(GaussianLogWeight(mu, sigma))
