"""The DRO contrastive core that every loss of the family is composed from.

A loss is four choices over the same computation, per anchor i and direction (image→text, text→image):

- pairwise loss:   ℓ_ij = s_ij − s_ii, optionally RHO-shifted by a reference model:
                   ℓ̂_ij = ℓ_ij − α(s^ref_ij − s^ref_ii), α = 1 in the paper
- aggregation:     KL-DRO over the candidates j ≠ i:  τ_i F_i,  F_i = log(ε + g_i),  g_i = mean_{j≠i} exp(ℓ̂_ij / τ_i)
- temperature:     fixed, learned by the loss's own Adam (from a given τ or one chosen from the first batch), the
                   model's learnable logit_scale, per sample, or predicted by a network
- per-sample state: SogCLR's moving average u_i ≈ g_i (inner learning rate γ), or none (u_i = the mini-batch g_i)

The gradient is the SogCLR estimator: ∇(τ_i F_i) ≈ τ_i ∇g_i / (ε + u_i), i.e. pair weights exp(ℓ̂_ij/τ_i)/(ε + u_i).
Anchors are this rank's samples, candidates are the global batch gathered *with* gradient (OpenCLIP's
`--local-loss --gather-with-grad` semantics); DDP's gradient averaging then yields the gradient of the global mean.

The pieces live beside it: the aggregations (`dense.py`, `tiled.py`), the temperature sources (`temperatures.py`),
the per-sample state (`state.py`), the collectives (`collectives.py`) and the dtype policy (`precision.py`).
Only torch is needed: nothing here knows about OpenCLIP's training loop.
"""
import math
from typing import Callable, Optional

import torch
from torch import nn

from .base import WINDOW_NOT_OPENED, ReferenceFeatures, check_eval_call, keep_in_graph
from .collectives import gather_batch
from .columns import column_step
from .dense import dense_aggregate
from .distill import ReferenceLogitScale, check_distill_weight, distill_from_reference
from .precision import at_least_float32, autocast_disabled, elementwise_dtype, pairwise_dtype
from .state import (MovingAverageState, SampleSharding, check_index_shape, check_same_window,
                    missing_state_message, per_sample_tables)
from .temperatures import check_target_negatives, rho_for_batch
from .tiled import negative_weight_entropy


def sogclr_estimate(log_g: torch.Tensor, log_u: torch.Tensor, log_eps: float) -> torch.Tensor:
    """A per-anchor term whose value is log(ε + u_i) and whose gradient is ∇g_i / (ε + u_i).

    log(ε + g_i) carries the gradient ∇g_i / (ε + g_i); rescaling it by r_i = (ε + g_i)/(ε + u_i) gives the
    SogCLR estimator. The detached remainder only fixes the value (and the τ-derivative, which must see
    log(ε + u_i) rather than r_i·log(ε + g_i)). With u = g (γ = 1) this is exactly log(ε + g_i).
    """
    log_eps_g = torch.logaddexp(log_g, torch.full_like(log_g, log_eps))
    log_eps_u = torch.logaddexp(log_u, torch.full_like(log_u, log_eps))
    ratio = torch.exp(log_eps_g.detach() - log_eps_u)
    return ratio * log_eps_g + (log_eps_u - ratio * log_eps_g).detach()


class DROContrastiveLoss(ReferenceFeatures, nn.Module):
    """Bimodal KL-DRO contrastive loss with an optional reference shift and per-sample state.

    Returns {'contrastive_loss': L} with L = mean_i [τ F_image_i + τ F_text_i] + ρ(τ_image + τ_text), where F uses
    u (so its value is the SogCLR estimate of the objective, exactly the mini-batch objective when γ = 1).
    `rho=None` takes ρ from the global batch B: log((B − 1)/k) with k = `target_negatives` (`rho_for_batch`).
    With `reference_shift`, `reference_weight` α scales the shift: ℓ̂ = ℓ − α ℓ^ref (1: the paper's RHO loss).

    `positive_in_denominator` replaces ε by 1/(B−1): the positive pair's own term exp(ℓ_ii/τ) = 1 joins the mean over
    the B − 1 candidates, so τ log(1/(B−1) + g_i) = τ [log(1 + Σ_{j≠i} exp(ℓ̂_ij/τ)) − log(B−1)], CLIP's
    softmax cross-entropy up to the factor τ and a constant.
    With `distill_weight` λ > 0 (a global τ only), the result is {'contrastive_loss': (1−λ) L,
    'distill_loss': λ n τ KD} with KD the MobileCLIP distillation term (`distill.py`) at the student's logit scale 1/τ
    and the teacher's `teacher_logit_scale` (a number, or 'auto': calibrated on the first batch). KD averages its two
    directions as CLIP's loss does, while L sums n τ-scaled cross-entropies (each direction's row, and with the
    column step its column): the factor n τ (τ detached) gives KD the share λ of the gradient that MobileCLIP's
    (1−λ)·CLIP + λ·KD gives it, so a λ means the same for `clip`, `balanced` and these losses;
    `distill_rows` > 0 computes it that many anchors at a time (with the tiled aggregation: its tile size). A τ the
    loss's own Adam learns steps on the DRO objective alone (App. C.3); KD's gradient reaches a τ learned as the
    model's logit_scale.

    With `column_step`, L also holds one column half-step of each direction's shifted logits, each anchor's u as its
    row's normaliser (`columns.py`; a global τ only; computed `distill_rows` samples at a time where that is set).

    A temperature source may learn outside the model's optimiser (per-sample τ): it then has a method
    `step(objective)`, called once per optimiser step with the per-anchor objective (whose τ-gradient it uses).

    In eval mode (`loss.eval()`, as for BatchNorm's running statistics) a call changes none of the loss's state: it
    returns the batch's own objective (u = g) at the current τ, reads no u, steps no τ, keeps no diagnostics for
    `metrics()`, and needs a sample `index` only for per-sample temperatures (a training sample's row); a τ or teacher
    scale still to be chosen from a first batch is chosen from this one and not kept. So a validation batch can be
    scored between training steps without touching the training run. With several ranks the call is still collective
    (it gathers the global batch): every rank makes it.
    """

    compiles_passes = True  # its passes over the pairwise matrix, where `compiles_for` the device

    def __init__(
            self,
            temperature: nn.Module,
            epsilon: Optional[float],
            rho: Optional[float] = 0.0,
            target_negatives: Optional[float] = None,
            state: Optional[MovingAverageState] = None,
            reference_shift: bool = False,
            reference_weight: float = 1.0,
            negative_log_weight=None,
            rank: int = 0,
            world_size: int = 1,
            aggregate: Callable = dense_aggregate,
            positive_in_denominator: bool = False,
            distill_weight: float = 0.0,
            teacher_logit_scale='auto',
            distill_rows: int = 0,
            column_step: bool = False,
    ):
        super().__init__()
        if positive_in_denominator != (epsilon is None):
            raise ValueError("give one of epsilon > 0 and positive_in_denominator (which takes ε's place), got "
                             + ("both" if epsilon is not None else "neither"))
        if epsilon is not None and epsilon <= 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        if rho is None:
            if target_negatives is None:
                raise ValueError("ρ from the batch (rho=None) needs target_negatives")
            check_target_negatives(target_negatives)
        if column_step and negative_log_weight is not None:
            raise ValueError("the column step normalises the DRO's own weights; it has no form with log-weights of "
                             "the candidates (ADNCE's)")
        if not 0 <= reference_weight < math.inf:
            raise ValueError(f"reference_weight α must be ≥ 0, got {reference_weight}")
        self.temperature = temperature
        self.log_eps = None if epsilon is None else math.log(epsilon)
        self.rho = rho
        self.target_negatives = target_negatives
        self.state = state
        self.reference_shift = reference_shift
        self.reference_weight = reference_weight
        self.negative_log_weight = negative_log_weight
        self.rank = rank
        self.world_size = world_size
        self.aggregate = aggregate
        self.positive_in_denominator = positive_in_denominator
        self.distill_weight = check_distill_weight(distill_weight)
        self.teacher_logit_scale = None
        self.distill_rows = distill_rows  # anchors per chunk of the KD term (0: all at once); the tiled core's T
        self.column_step = column_step
        if distill_weight > 0:
            self.teacher_logit_scale = ReferenceLogitScale(teacher_logit_scale, world_size)
        self._window = None  # (accumulation window's index, its log u) while --accum-freq replays a window
        self._window_tau = None  # the window's temperatures, from its first call
        self._last = {}

    def set_epoch(self, epoch: int):
        for part in (self.state, self.temperature):
            if hasattr(part, 'set_epoch'):
                part.set_epoch(epoch)

    def set_total_steps(self, total_steps: int) -> Optional[float]:
        """The run's number of optimiser steps, before training: what an 'auto' lr_tau is set from. Returns the
        lr_tau it set, or None where τ is not learned that way or has a given lr_tau."""
        if hasattr(self.temperature, 'set_total_steps'):
            return self.temperature.set_total_steps(total_steps)
        return None

    @property
    def sharding(self) -> Optional[SampleSharding]:
        """The layout of this loss's per-sample tables (None when it keeps none)."""
        tables = per_sample_tables(self)
        return next(iter(tables.values()))[1] if tables else None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Also accepts the whole per-sample tables (N rows) in a sharded loss, which keeps its block of them."""
        tables = per_sample_tables(self)
        missing = [key for key in tables if key not in state_dict]
        if missing:
            raise RuntimeError(missing_state_message(missing))
        state_dict = dict(state_dict)
        for key, (_, sharding) in tables.items():
            saved = state_dict[key].numel()
            if saved == sharding.num_samples:
                state_dict[key] = state_dict[key][sharding.start:sharding.stop]
            elif not (sharding.sharded and saved == sharding.size):  # else: this rank's block of a sharded loss
                raise RuntimeError(f"the checkpoint's per-sample state covers {saved} samples, this run's data "
                                   f"{sharding.num_samples}: resume with the same training data")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _state_rows(self, index, log_g_image, log_g_text, accum_step):
        if self.state is None:
            return log_g_image.detach(), log_g_text.detach()
        if index is None:
            raise ValueError("this loss keeps per-sample state and needs the batch's sample `index`")
        if accum_step:  # the same window again, with gradients through another chunk: u was updated at step 0
            window_index, log_u = self._window
            check_same_window(window_index, index)
            return log_u
        log_u = self.state.update(index, log_g_image.detach(), log_g_text.detach())
        self._window = (index, log_u) if accum_step is not None else None
        return log_u

    def _shift(self, reference):
        """The reference features of the shift α·ℓ^ref: the image side scaled by α scales every reference similarity,
        image→text and text→image, positives included, so both aggregations take the shift as they take α = 1."""
        if self.reference_weight == 1:
            return reference
        ref_image, ref_text, all_ref_image, all_ref_text = reference
        return ref_image * self.reference_weight, ref_text, all_ref_image * self.reference_weight, all_ref_text

    def _temperatures(self, logit_scale, index, image_features, text_features, reference, accum_step):
        if accum_step:
            # a later call on the same window: the first call's τ, as constants. τ's gradient depends only on the
            # window's feature values, so the first call already carried all of it (and any per-sample τ step)
            if self._window_tau is None:
                raise RuntimeError(WINDOW_NOT_OPENED)
            tau_image, tau_text = self._window_tau
            return keep_in_graph(tau_image, logit_scale, *self.temperature.parameters()), tau_text
        tau_image, tau_text = self.temperature(logit_scale=logit_scale, index=index, image_features=image_features,
                                               text_features=text_features, reference=reference)
        like = dict(device=image_features.device, dtype=elementwise_dtype(image_features.dtype))
        tau_image, tau_text = tau_image.to(**like), tau_text.to(**like)
        if self.training:
            self._window_tau = (tau_image.detach(), tau_text.detach()) if accum_step is not None else None
        return tau_image, tau_text

    def forward(self, image_features, text_features, logit_scale=None, index=None,
                ref_image_features=None, ref_text_features=None, accum_step=None, output_dict=False, **_):
        if self.reference_shift:
            self.require_reference(ref_image_features, ref_text_features, "shifts by the reference model")
        elif self.distill_weight > 0:
            self.require_reference(ref_image_features, ref_text_features, "distills from the reference model")
        check_eval_call(self, accum_step)
        if self.training and not torch.is_grad_enabled() and (self.sharding is not None
                                                               or hasattr(self.temperature, 'step')):
            # refused before any state is written: a training call updates u and steps τ from its gradient
            raise RuntimeError("a loss in training mode learns from each call (per-sample u, τ): call it with "
                               "gradients enabled, or put it in eval mode (loss.eval()) to score a batch without "
                               "learning")
        rows = {'image_features': image_features.shape[0], 'text_features': text_features.shape[0]}
        if self.reference_shift or self.distill_weight > 0:
            rows.update(ref_image_features=ref_image_features.shape[0], ref_text_features=ref_text_features.shape[0])
        if len(set(rows.values())) > 1:  # the tiled aggregation said so, the dense one failed in a matrix product
            raise ValueError(f"one row per sample of the batch in each of the features, got "
                             f"{', '.join(f'{rows[k]} {k}' for k in rows)}")
        if index is not None:
            check_index_shape(index, image_features.shape[0])
        device = image_features.device
        for part in (self.state, self.temperature):
            if getattr(part, 'sharding', None) is not None:
                part.sharding.new_call()
        # the products in autocast's 16-bit dtype, or the features' own; everything elementwise in float32
        dtype = pairwise_dtype(image_features, text_features)
        with autocast_disabled(device):
            image, text = image_features.to(dtype), text_features.to(dtype)
            all_image = gather_batch(image, self.world_size, with_grad=True, device=device)
            all_text = gather_batch(text, self.world_size, with_grad=True, device=device)
            reference = None
            if self.reference_shift or self.distill_weight > 0:
                ref_image, ref_text = ref_image_features.to(dtype), ref_text_features.to(dtype)
                reference = (ref_image, ref_text,
                             gather_batch(ref_image, self.world_size, with_grad=False, device=device),
                             gather_batch(ref_text, self.world_size, with_grad=False, device=device))
            if all_text.shape[0] < 2:
                raise ValueError(f"a global batch of {all_text.shape[0]}: the DRO losses need at least 2 samples "
                                 f"(an anchor's negatives are the batch's other samples)")
            offset = self.rank * image.shape[0]
            log_eps = -math.log(all_text.shape[0] - 1) if self.positive_in_denominator else self.log_eps
            shift = self._shift(reference) if self.reference_shift else None
            # a temperature chosen from the reference's margins sees them as the DRO weights do: α-scaled
            tau_image, tau_text = self._temperatures(logit_scale, index, image, text, shift, accum_step)
            inv_tau_image, inv_tau_text = 1.0 / tau_image, 1.0 / tau_text
            aggregate_args = (image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text, shift,
                              self.negative_log_weight)
            if self.column_step and self.aggregate is dense_aggregate:  # the column step reads the core's d
                log_g_image, log_g_text, pairs = dense_aggregate(*aggregate_args, keep_pairs=True)
            else:
                (log_g_image, log_g_text), pairs = self.aggregate(*aggregate_args), None
            if self.training:
                log_u_image, log_u_text = self._state_rows(index, log_g_image, log_g_text, accum_step)
            else:  # the batch's own objective: u = g, no state read or written
                log_u_image, log_u_text = log_g_image.detach(), log_g_text.detach()
            rho = rho_for_batch(all_text.shape[0], self.target_negatives) if self.rho is None else self.rho

            def per_anchor_objective(log_u_image, log_u_text):  # both directions
                return (tau_image * sogclr_estimate(log_g_image, log_u_image, log_eps)
                        + tau_text * sogclr_estimate(log_g_text, log_u_text, log_eps)
                        + rho * (tau_image + tau_text))
            per_anchor = per_anchor_objective(log_u_image, log_u_text)
            loss = per_anchor.mean()
            if self.column_step:  # not in per_anchor: a learned τ steps on the DRO objective alone (`columns.py`)
                columns = column_step(image, text, all_image, all_text, shift, tau_image, tau_text, log_u_image,
                                      log_u_text, log_eps, self.world_size, offset, rows=self.distill_rows,
                                      pairs=pairs).mean()
                loss = loss + columns
            if self.training and not accum_step and hasattr(self.temperature, 'step'):
                # By default τ steps on the estimate with u, as the paper's does. A sample's u is from its last
                # visit; while the model improves, u > g on every revisit, and log(ε + u) − (g/(ε + u))·E_p[ℓ/τ]
                # overstates the τ-derivative by more the smaller τ is, so τ keeps falling (an annealing that
                # measured better at short runs; on small data trained for many epochs it reaches τ_min). On this
                # batch's objective (u = g) the derivative is ρ − KL(p_i ‖ uniform) of the weights the batch has,
                # and τ settles where ρ puts it (k effective negatives for ρ = auto).
                on_batch = getattr(self.temperature, 'steps_on_batch', False)
                self.temperature.step(per_anchor_objective(log_g_image.detach(), log_g_text.detach()) if on_batch
                                      else per_anchor)
            losses = {'contrastive_loss': loss}
            if self.training:  # what metrics() needs, detached; the features, not the b×B matrices: O((b + B)·d)
                detached = [x.detach() for x in (image, text, all_image, all_text, inv_tau_image, inv_tau_text)]
                self._last = dict(log_g_image=log_g_image.detach(), log_g_text=log_g_text.detach(),
                                  log_u_image=log_u_image, log_u_text=log_u_text, log_eps=log_eps, rho=rho,
                                  tau_image=tau_image.detach(), tau_text=tau_text.detach(),
                                  pairs=(*detached, offset, shift))
                if self.column_step:
                    self._last['column_step'] = columns.detach()
            if self.distill_weight > 0:
                if tau_image.dim():
                    raise ValueError("distillation needs a global temperature (its student logit scale is 1/τ)")
                kd, teacher_scale = distill_from_reference(self.teacher_logit_scale,
                                                           (image, text, all_image, all_text), reference,
                                                           1.0 / tau_image, self.distill_rows)
                cross_entropies = 2 * (2 if self.column_step else 1)
                losses = {'contrastive_loss': (1 - self.distill_weight) * loss,
                          'distill_loss': self.distill_weight * cross_entropies * tau_image.detach() * kd}
                if self.training:
                    self._last.update(distill=kd.detach(), teacher_logit_scale=teacher_scale)
        if output_dict:
            return losses
        return sum(losses.values())

    def objective(self) -> torch.Tensor:
        """The mini-batch value of the objective of the last call (not the surrogate): mean_i τF_i over both
        directions with the batch's own g_i, plus the ρ term."""
        last = self._last
        log_g_image, log_g_text = last['log_g_image'], last['log_g_text']
        f_image = last['tau_image'] * torch.logaddexp(log_g_image, log_g_image.new_full((), last['log_eps']))
        f_text = last['tau_text'] * torch.logaddexp(log_g_text, log_g_text.new_full((), last['log_eps']))
        return (f_image + f_text).mean() + last['rho'] * (last['tau_image'] + last['tau_text']).mean()

    def effective_negatives(self) -> torch.Tensor:
        """Of the last call: exp of the entropy of every anchor's DRO weights p_ij over its negatives j ≠ i (B − 1
        when the weights are uniform, 1 when one negative takes them all), mean over the anchors of both
        directions. Recomputed here, in one streaming pass, so that the loss itself pays nothing for it."""
        image, text, all_image, all_text, inv_tau_image, inv_tau_text, offset, shift = self._last['pairs']
        ref_image, ref_text, all_ref_image, all_ref_text = shift if shift is not None else (None,) * 4
        entropy_image = negative_weight_entropy(image, all_text, offset, inv_tau_image, ref_image, all_ref_text,
                                                self.negative_log_weight)
        entropy_text = negative_weight_entropy(text, all_image, offset, inv_tau_text, ref_text, all_ref_image,
                                               self.negative_log_weight)
        return torch.cat([entropy_image, entropy_text]).exp().mean()

    def reference_margin(self) -> torch.Tensor:
        """Of the last call, with a reference shift: mean over the anchors of both directions and their negatives of
        α(s^ref_ii − s^ref_ij), how far the shift ranks the positive above the negatives (at α = 1, the reference
        model's own margin)."""
        shift = self._last['pairs'][-1]
        ref_image, ref_text, all_ref_image, all_ref_text = (at_least_float32(x) for x in shift)
        positive = (ref_image * ref_text).sum(1)  # s^ref_ii, the same pair in both directions
        # mean_{j≠i} s^ref_ij = (ref_i · Σ_j candidate_j − s^ref_ii) / (B − 1): no b×B matrix needed
        negatives = all_ref_text.shape[0] - 1
        mean_image = (ref_image @ all_ref_text.sum(0) - positive) / negatives
        mean_text = (ref_text @ all_ref_image.sum(0) - positive) / negatives
        return (positive - (mean_image + mean_text) / 2).mean()

    def metrics(self) -> dict:
        """Diagnostics of the last call, for OpenCLIP's logger (rank 0; no collectives)."""
        if not self._last:
            return {}
        last = self._last
        out = {
            'objective': self.objective().item(),
            'tau_image_mean': last['tau_image'].mean().item(),
            'tau_text_mean': last['tau_text'].mean().item(),
            'log_u_image_mean': last['log_u_image'].mean().item(),
            'log_u_text_mean': last['log_u_text'].mean().item(),
            'effective_negatives': self.effective_negatives().item(),
        }
        if self.rho is None:  # from the batch
            out['rho'] = last['rho']
        if self.reference_shift:
            out['reference_margin'] = self.reference_margin().item()
        if 'column_step' in last:
            out['column_step'] = last['column_step'].item()
        if 'distill' in last:
            out['distill'] = last['distill'].item()
            out['teacher_logit_scale'] = last['teacher_logit_scale'].item()
        if self.state is not None:
            out['gamma'] = self.state.gamma
            out['state_coverage'] = self.state.coverage()
        return out
