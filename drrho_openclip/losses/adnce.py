"""ADNCE's re-weighting of the negatives (Wu et al., 2023; adnce.md), as the core's `negative_log_weight`.

Each negative j of anchor i gets the detached Gaussian weight w_ij = exp(−(s_ij − µ)²/(2σ²)) of its raw cosine
similarity s_ij (not of s/τ, nor of exp(s/τ): the published pseudocode's slip), normalised to mean 1 over the
anchor's negatives, so the row's mean over j ≠ i becomes mean_j w̄_ij exp(ℓ̂_ij/τ). Per row, in both directions,
over the global negatives; in log space, so τ = 0.01 does not overflow.

The positive (adnce.md §5's recommended CLIP variant): unweighted and kept in the denominator,
ℓ_i = −s_ii/τ + log(e^{s_ii/τ} + Σ_{j≠i} w̄_ij e^{s_ij/τ}) = log(1 + (B−1) g_i). In the core that is ε = 1/(B−1) in
τ log(ε + g_i) (`positive_in_denominator`, which replaces the ε option), so with a fixed τ the loss is
2τ (L_ADNCE − log(B−1)), L_ADNCE the mean of the two directions: ADNCE's gradient times 2τ; σ → ∞ gives CLIP's.
"""
from .tiled import RowNormalizedLogWeight


class GaussianLogWeight:
    """log w_ij = −(s_ij − µ)² / (2σ²), elementwise (so the tiled aggregation can stream it)."""

    def __init__(self, mu: float, sigma: float):
        if sigma <= 0:
            raise ValueError(f"ADNCE's σ (adnce_sigma) must be > 0, got {sigma}")
        self.mu, self.sigma = mu, sigma

    def __call__(self, sim, positive_mask):
        # one new b×B matrix, squared and scaled in place (each new one is a fresh allocation: page faults on a CPU)
        return (sim - self.mu).square_().mul_(-0.5 / self.sigma ** 2)

    def __repr__(self):
        return f'{type(self).__name__}(mu={self.mu}, sigma={self.sigma})'


def adnce_log_weight(mu: float, sigma: float) -> RowNormalizedLogWeight:
    """The core's `negative_log_weight` for ADNCE: log w̄_ij = log w_ij − log mean_{k≠i} w_ik."""
    return RowNormalizedLogWeight(GaussianLogWeight(mu, sigma))
