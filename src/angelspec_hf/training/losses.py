"""AngelSpec training losses (DESIGN.md section 2), per draft position.

Notation: target distribution ``p``, draft distribution ``q``, both over the target vocabulary.
Inputs are logits of shape ``(..., V)``; distributions are taken with a softmax in float32.
Per-position quantities are computed in row chunks (``CHUNK_ROWS`` positions at a time) so that
a 49k-151k vocabulary never needs more than ``CHUNK_ROWS x V`` extra floats at once.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from ..modeling_angelspec_common import VocabSubsetHead

CHUNK_ROWS = 1024

logger = logging.getLogger(__name__)

LogitTransform = Callable[[torch.Tensor], torch.Tensor]


def target_logit_transform(config) -> LogitTransform | None:
    """What the target's forward does to ``lm_head`` of its final state before returning logits
    (None: nothing): Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``,
    Gemma 2 caps with ``final_logit_softcapping``. Soft labels are the target's own distribution,
    so they need it too; without it Cohere's labels would be 16x too sharp.

    The drafter's own logits stay ``lm_head`` of its state, as at inference: it learns the scale.
    """
    text = config.get_text_config()
    scale = getattr(text, "logit_scale", None)
    divisor = getattr(text, "logits_scaling", None)
    cap = getattr(text, "final_logit_softcapping", None)
    steps = []
    if isinstance(scale, (int, float)) and scale != 1:
        steps.append(lambda logits: logits * scale)
    if isinstance(divisor, (int, float)) and divisor != 1:
        steps.append(lambda logits: logits / divisor)
    if isinstance(cap, (int, float)) and cap > 0:
        steps.append(lambda logits: torch.tanh(logits / cap) * cap)
    if not steps:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        for step in steps:
            logits = step(logits)
        return logits

    return transform


def check_target_logits(target, transform: LogitTransform | None, input_ids: torch.Tensor) -> float:
    """Largest difference between the target's logits and ``lm_head`` of its final state through
    ``transform`` on ``input_ids`` (1, n); warns when they differ, since the soft labels are built
    that way: a family that transforms its logits otherwise needs its rule in `target_logit_transform`."""
    with torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
        out = target(input_ids=input_ids, output_hidden_states=True)
        # hidden_states[-1] is the final normed state, what training reads (`features.run_target`).
        rebuilt = target.get_output_embeddings()(out.hidden_states[-1]).float()
        if transform is not None:
            rebuilt = transform(rebuilt)
        logits = out.logits.float()
    difference = (rebuilt - logits).abs().max().item()
    if difference > 1e-3 * max(logits.abs().max().item(), 1.0):
        logger.warning(
            "The soft labels (lm_head of the target's final state) differ from %s's logits by up to %.3g: "
            "its forward transforms the logits in a way angelspec-hf does not know, so the drafter trains "
            "against another distribution than the target's.", target.config.model_type, difference)
    return difference


def _rowwise(function, *tensors: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Apply ``function`` to matching row chunks of tensors shaped (..., V); returns shape (...),
    or (..., width) for a function that gives ``width`` values per row."""
    shape = (*tensors[0].shape[:-1], *(() if width is None else (width,)))
    # split, not slicing: a slice's backward fills a zero tensor of the whole input for every chunk
    # (measured: 1.4 s of a 6.3 s MTP training step), split's concatenates the chunks' gradients once.
    chunks = zip(*(t.reshape(-1, t.shape[-1]).split(CHUNK_ROWS) for t in tensors))
    out = [function(*parts) for parts in chunks]
    return torch.cat(out).reshape(shape) if out else tensors[0].new_zeros(shape)


def _log_probabilities(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log_softmax(p_logits.float(), dim=-1), torch.log_softmax(q_logits.float(), dim=-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # 0 * log 0 = 0, and -inf draft logits (reduced vocabularies) only matter where p > 0.
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def _tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p - q).abs().sum(-1)


def forward_kl(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position."""

    def chunk(p_logits, q_logits):
        log_p, log_q = _log_probabilities(p_logits, q_logits)
        return _kl(log_p, log_q, log_p.exp())

    return _rowwise(chunk, target_logits, draft_logits)


def total_variation(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1/2 sum |p - q| per position."""

    def chunk(p_logits, q_logits):
        return _tv(torch.softmax(p_logits.float(), -1), torch.softmax(q_logits.float(), -1))

    return _rowwise(chunk, target_logits, draft_logits)


def _kl_and_tv(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward_kl`` and ``total_variation`` from one pass over the vocabulary (the softmaxes
    and the backward through them shared: they are most of a training step's elementwise work)."""

    def chunk(p_logits, q_logits):
        log_p, log_q = _log_probabilities(p_logits, q_logits)
        p, q = log_p.exp(), log_q.exp()
        return torch.stack([_kl(log_p, log_q, p), _tv(p, q)], dim=-1)

    return _rowwise(chunk, target_logits, draft_logits, width=2).unbind(-1)


def acceptance_probability(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """alpha = sum min(p, q) = 1 - TV(p, q): the chance speculative sampling accepts the draft."""
    return 1.0 - total_variation(target_logits, draft_logits)


def lk_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor, eta: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``lambda * KL(p||q) + (1 - lambda) * TV(p, q)`` with ``lambda = exp(-eta * stopgrad(alpha))``.

    KL pulls a far-off draft towards the target's support; as acceptance grows the weight moves to
    TV, which is what acceptance actually measures. Returns (loss, alpha) per position.
    """
    kl, tv = _kl_and_tv(target_logits, draft_logits)
    alpha = 1.0 - tv
    weight = torch.exp(-eta * alpha.detach())
    return weight * kl + (1.0 - weight) * tv, alpha


def end_to_end_tv_loss(alphas: torch.Tensor) -> torch.Tensor:
    """``1 - (1/D) sum_{m<D} prod_{k<=m} alpha_k`` over the last dimension (a chain of D positions).

    ``prod_{k<=m} alpha_k`` is the probability that draft position m is reached and accepted, so
    the loss is one minus the expected accepted length divided by D; deep positions only count
    when every earlier one is accepted.
    """
    return 1.0 - torch.cumprod(alphas, dim=-1).mean(dim=-1)


def expected_accepted_length(alphas: torch.Tensor) -> torch.Tensor:
    """``sum_m prod_{k<=m} alpha_k``: expected accepted drafts of a chain (tau - 1 under sampling)."""
    return torch.cumprod(alphas, dim=-1).sum(dim=-1)


def dpace_weights(confidences: torch.Tensor, smoothing: float = 0.5) -> torch.Tensor:
    """D-PACE position weights, detached: ``w_k = sum_{j>=k} prod_{i<=j} s_i``, ``s = (1-a) c + a``.

    ``confidences`` (..., D) are the draft probabilities of the true tokens. A position weighs as
    much as the expected number of accepted positions it leads to.
    """
    survival = torch.cumprod((1.0 - smoothing) * confidences.detach() + smoothing, dim=-1)
    return survival.flip(-1).cumsum(-1).flip(-1)


def position_decay(num_positions: int, gamma: float = 0.8, device=None) -> torch.Tensor:
    """``gamma ** k`` for k = 0..D-1: a fixed alternative to D-PACE for autoregressive chains."""
    return torch.tensor([gamma**k for k in range(num_positions)], device=device)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(math.ulp(1.0))


def vocabulary_logits(drafter, lm_head, draft_hidden: torch.Tensor, target_hidden: torch.Tensor,
                      target_transform: LogitTransform | None = None):
    """Draft and target logits over the drafter's vocabulary (the reduced one if it has one), for
    MTP and block drafters alike (both expose ``vocab_logits`` and ``draft_token_ids``).

    With a reduced vocabulary the target is renormalised over it (EAGLE-3's choice): outside it
    the drafter has no mass to move, and full-vocabulary logits would cost V/|draft| times more.
    """
    return (drafter.vocab_logits(draft_hidden, lm_head).float(),
            target_vocabulary_logits(drafter, lm_head, target_hidden, target_transform))


def target_vocabulary_logits(drafter, lm_head, target_hidden: torch.Tensor,
                             transform: LogitTransform | None = None) -> torch.Tensor:
    """The target side of `vocabulary_logits` alone (the soft labels), in float32, through the
    target's own logit ``transform`` (`target_logit_transform`), which is elementwise, so a
    reduced vocabulary's columns get it alike."""
    # The target's own precision even under mixed-precision training: bfloat16 logits would move
    # every target probability by up to a few percent.
    with torch.autocast(target_hidden.device.type, enabled=False):
        if not drafter.config.uses_reduced_vocab:
            logits = lm_head(target_hidden).float()
        else:
            rows = VocabSubsetHead(lm_head, drafter.draft_token_ids(), drafter.config.vocab_size)
            logits = rows.subset_logits(target_hidden).float()
        return logits if transform is None else transform(logits)
