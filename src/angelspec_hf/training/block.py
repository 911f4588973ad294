"""Block (DFly / DFlash / DFlare) training step: many random anchors per sequence in one forward.

For an anchor at position ``p`` the block is ``[x_p, mask, ..., mask]`` at positions
``p..p+B-1``; it sees the context features of positions ``< p`` (what inference has committed)
and its own block, never another anchor's. Block index ``j >= 1`` is trained towards the target's
next-token distribution at position ``p+j-1`` (the target's view of token ``p+j``); the
correction head is teacher-forced with the sequence's token at ``p+j-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling_angelspec_dfly import DFlyDrafter
from .growth import deeper_model
from .losses import (
    acceptance_probability,
    dpace_weights,
    end_to_end_tv_loss,
    expected_accepted_length,
    lk_loss,
    vocabulary_logits,
    weighted_mean,
)

OBJECTIVES = ("lk", "tv")


@dataclass
class BlockLoss:
    loss: torch.Tensor
    alpha: torch.Tensor  # (batch, anchors, B-1) acceptance probability per draft position
    greedy_match: torch.Tensor  # (batch, anchors, B-1) draft argmax == target argmax

    def metrics(self) -> dict[str, float]:
        accepted_greedy = expected_accepted_length(self.greedy_match.float())
        return {
            "alpha": self.alpha.mean().item(),
            "alpha_first": self.alpha[..., 0].mean().item(),
            "greedy_tau_estimate": 1.0 + accepted_greedy.mean().item(),
        }


def sample_anchors(loss_start: torch.Tensor, lengths: torch.Tensor, block_size: int, num_anchors: int, generator=None) -> torch.Tensor:
    """(batch, num_anchors) anchor positions in ``[max(loss_start, 1), length - block_size + 1]`` per row.

    Rows with fewer candidate positions than ``num_anchors`` repeat some (the loss is a mean, so a
    repeated anchor only weighs twice).
    """
    anchors = []
    for start, length in zip(loss_start.tolist(), lengths.tolist()):
        low, high = max(int(start), 1), int(length) - block_size + 1
        if high < low:
            raise ValueError(f"a sequence of length {length} leaves no room for a block of {block_size} after {start}")
        candidates = torch.arange(low, high + 1)
        order = torch.randperm(candidates.numel(), generator=generator)
        picks = candidates[order[:num_anchors]]
        if picks.numel() < num_anchors:
            picks = picks[torch.arange(num_anchors) % picks.numel()]
        anchors.append(picks.sort().values)
    return torch.stack(anchors).to(loss_start.device)


def grow_layers(drafter, num_hidden_layers: int):
    """A copy of a trained block drafter with draft layers appended that start as the identity.

    Each new layer is a copy of the last trained one (its per-layer mix of target layers too) with
    the attention output and MLP down projections zeroed, so its residual branches add nothing: the
    grown drafter drafts exactly what ``drafter`` does, and training continues from there with
    more capacity instead of from scratch. Gradients reach the zeroed projections at once (their
    inputs are the copied layer's activations) and the rest of each new layer once they move.
    """
    grown, state = deeper_model(drafter, DFlyDrafter, num_hidden_layers, "block (DFly/DFlash/DFlare)")
    old = drafter.config.num_hidden_layers
    last = {key.split(".", 2)[2]: value for key, value in state.items() if key.startswith(f"layers.{old - 1}.")}
    for index in range(old, num_hidden_layers):
        state.update({f"layers.{index}.{name}": value.clone() for name, value in last.items()})
        state[f"layers.{index}.o_proj.weight"] = torch.zeros_like(last["o_proj.weight"])
        state[f"layers.{index}.mlp.down_proj.weight"] = torch.zeros_like(last["mlp.down_proj.weight"])
    if "layer_fusion_weights" in state:
        mixes = state["layer_fusion_weights"]
        state["layer_fusion_weights"] = torch.cat([mixes, mixes[-1:].expand(num_hidden_layers - old, -1)])
    grown.load_state_dict(state, strict=True)
    return grown.train(drafter.training)


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_length: int) -> torch.Tensor:
    """Boolean (batch, 1, anchors*B, context + anchors*B): context keys before the anchor, own block."""
    batch, num_anchors = anchors.shape
    positions = torch.arange(context_length, device=anchors.device)
    context = positions[None, None, :] < anchors[..., None]  # (batch, anchors, context)
    context = context[:, :, None, :].expand(batch, num_anchors, block_size, context_length)
    owner = torch.arange(num_anchors, device=anchors.device).repeat_interleave(block_size)
    own_block = (owner[:, None] == owner[None, :])[None].expand(batch, -1, -1)
    mask = torch.cat([context.reshape(batch, num_anchors * block_size, context_length), own_block], dim=-1)
    return mask[:, None]


def block_loss(
    drafter,
    features: list[torch.Tensor],
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    embed_tokens,
    lm_head,
    anchors: torch.Tensor,
    objective: str = "lk",
    eta: float = 3.0,
    target_transform=None,
) -> BlockLoss:
    """Loss of a DFly-family drafter on a batch, for the given anchors.

    ``target_hidden`` is the target's final (normed) hidden state; its ``lm_head`` is applied only
    at the positions that serve as labels, which on CPU halves the cost of the soft labels;
    ``target_transform`` is what the target's forward does to those logits (`target_logit_transform`).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
    config = drafter.config
    batch, length = input_ids.shape
    block, num_anchors = config.block_size, anchors.shape[1]
    dtype = drafter.dtype
    context_kv = drafter.context_keys_values(
        [f.to(dtype) for f in features], torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
    )
    block_positions = anchors[..., None] + torch.arange(block, device=anchors.device)  # (batch, anchors, B)
    block_ids = torch.full_like(block_positions, config.mask_token_id)
    block_ids[..., 0] = input_ids.gather(1, anchors)
    mask = block_attention_mask(anchors, block, length)
    z = drafter(embed_tokens(block_ids.flatten(1)).to(dtype), block_positions.flatten(1), context_kv, mask)
    z = z.view(batch, num_anchors, block, -1)[:, :, 1:]
    label_positions = block_positions[..., :-1]  # target's view of token p+j sits at position p+j-1
    previous = input_ids.gather(1, label_positions.flatten(1)).view(batch, num_anchors, block - 1)
    z = drafter.correct(z, embed_tokens(previous).to(dtype))
    index = label_positions.flatten(1)[..., None].expand(-1, -1, target_hidden.shape[-1])
    draft_logits, target = vocabulary_logits(drafter, lm_head, z, target_hidden.gather(1, index),
                                               target_transform)
    target = target.view(batch, num_anchors, block - 1, -1)
    target_tokens = target.argmax(-1)
    greedy_match = draft_logits.argmax(-1) == target_tokens
    if objective == "lk":
        per_position, alpha = lk_loss(target, draft_logits, eta)
        confidence = torch.softmax(draft_logits, -1).gather(-1, target_tokens[..., None]).squeeze(-1)
        loss = weighted_mean(per_position, dpace_weights(confidence))
    else:
        alpha = acceptance_probability(target, draft_logits)
        loss = end_to_end_tv_loss(alpha).mean()
    return BlockLoss(loss=loss, alpha=alpha.detach(), greedy_match=greedy_match)
