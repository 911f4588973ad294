"""MTP training with training-time test (TTT): the draft chain unrolled D steps per training step.

Step 0 at position t reads the fused target feature and token t+1 and predicts token t+2. Step
k >= 1 reads step k-1's own output hidden state and its own argmax token, at position t+k, and
predicts token t+k+2; its keys are the committed (step-0) keys of positions <= t plus the keys
its own chain wrote at steps 1..k. That is exactly what inference attends to, so deep positions
learn to recover from the drafter's own mistakes; a drafter of several layers keeps such keys per
layer. With ``ttt=False`` only step 0 is trained
(teacher forcing, the ablation). Rows never attend across ``document_ids`` boundaries, so packed
sequences stay separate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .growth import deeper_model
from .losses import (
    acceptance_probability,
    end_to_end_tv_loss,
    expected_accepted_length,
    lk_loss,
    position_decay,
    target_vocabulary_logits,
    weighted_mean,
)

OBJECTIVES = ("lk", "tv")


@dataclass
class ChainLoss:
    loss: torch.Tensor
    alpha: torch.Tensor  # (batch, positions, D) acceptance probability per step
    greedy_match: torch.Tensor  # (batch, positions, D)
    valid: torch.Tensor  # (batch, positions) chains whose every step has a label
    draft_tokens: torch.Tensor  # (batch, positions, D) the chain's greedy tokens (target ids)

    def metrics(self) -> dict[str, float]:
        """Means over the valid chains; none for a batch without one (they were NaN in the logs)."""
        valid = self.valid
        if not bool(valid.any()):
            return {}
        matched = expected_accepted_length(self.greedy_match.float())[valid]
        return {
            "alpha": self.alpha[valid].mean().item(),
            "alpha_first": self.alpha[..., 0][valid].mean().item(),
            "greedy_tau_estimate": 1.0 + matched.mean().item(),
        }


def step_attention(attn_module, x: torch.Tensor, positions: torch.Tensor, committed, chain, mask: torch.Tensor):
    """Attention of one TTT step: masked over the committed (step-0) keys, diagonal over the chain.

    ``committed`` is None at step 0, whose own keys then become the committed ones. Returns the
    attention output and this step's ``(keys, values)``.
    """
    heads, kv_heads, dim = attn_module.num_heads, attn_module.num_kv_heads, attn_module.head_dim
    q, k, v = attn_module.project(x, positions)
    diagonal = [] if committed is None else [*chain, (k, v)]
    committed = (k, v) if committed is None else committed
    group = heads // kv_heads
    expand = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731
    scale = dim**-0.5
    scores = [(q @ expand(committed[0]).transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))]
    scores += [(q * expand(key)).sum(-1, keepdim=True) * scale for key, _ in diagonal]
    weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    length = committed[0].shape[2]
    out = weights[..., :length] @ expand(committed[1])
    for index, (_, value) in enumerate(diagonal):
        out = out + weights[..., length + index : length + index + 1] * expand(value)
    out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
    return attn_module.o_proj(out), (k, v)


def chain_loss(
    drafter,
    features: list[torch.Tensor],
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    embed_tokens,
    lm_head,
    loss_start: torch.Tensor,
    lengths: torch.Tensor,
    steps: int | None = None,
    ttt: bool = True,
    objective: str = "lk",
    eta: float = 3.0,
    document_ids: torch.Tensor | None = None,
    target_transform=None,
) -> ChainLoss:
    """Loss of an `MTPDrafter` over every chain origin of a batch, unrolled ``steps`` times.

    ``target_hidden`` is the target's final (normed) hidden state; ``loss_start``/``lengths``
    bound, per row, the positions whose tokens are trained (the response) and the real tokens;
    ``target_transform`` is what the target's forward does to its logits (`target_logit_transform`).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
    depth = (steps or drafter.config.ttt_steps) if ttt else 1
    batch, length = input_ids.shape
    origins = length - 1  # chain origin t reads (feature t, token t+1)
    device, dtype = input_ids.device, drafter.dtype
    positions = torch.arange(origins, device=device)[None].expand(batch, -1)
    allowed = torch.ones(origins, origins, dtype=torch.bool, device=device).tril()[None, None]
    if document_ids is not None:
        same = document_ids[:, :origins, None] == document_ids[:, None, :origins]
        allowed = allowed & same[:, None]
    hidden = drafter.fuse([f[:, :origins].to(dtype) for f in features])
    tokens = input_ids[:, 1:]
    # Step k of origin t predicts token t+k+2, whose target view sits at position t+k+1: every
    # step's soft labels are rows of one target pass over positions 1..length-1.
    labels = target_vocabulary_logits(drafter, lm_head, target_hidden[:, 1:], target_transform)
    label_best = labels.argmax(-1)
    layers = drafter.config.num_hidden_layers
    committed, chains, draft_tokens = [None] * layers, [[] for _ in range(layers)], []
    per_step: dict[str, list[torch.Tensor]] = {"alpha": [], "loss": [], "greedy": []}
    origin = torch.arange(origins, device=device)
    for step in range(depth):

        def attention(layer: int, module, x: torch.Tensor, step: int = step) -> torch.Tensor:
            out, present = step_attention(module, x, positions + step, committed[layer], chains[layer], allowed)
            if committed[layer] is None:
                committed[layer] = present
            else:
                chains[layer].append(present)
            return out

        hidden = drafter.decode(hidden, embed_tokens(tokens).to(dtype), positions + step, attention)
        # Per step, not stacked: the vocabulary-wide logits are the bulk of the step's memory traffic.
        draft = drafter.vocab_logits(hidden, lm_head).float()
        label_index = (origin + step).clamp(max=origins - 1)
        if objective == "lk":
            loss, alpha = lk_loss(labels[:, label_index], draft, eta)
            per_step["loss"].append(loss)
        else:
            alpha = acceptance_probability(labels[:, label_index], draft)
        per_step["alpha"].append(alpha)
        with torch.no_grad():
            best = draft.argmax(-1)
            per_step["greedy"].append(best == label_best[:, label_index])
            tokens = drafter.draft_token_ids()[best] if drafter.config.uses_reduced_vocab else best
        draft_tokens.append(tokens)
    alpha, greedy_match = torch.stack(per_step["alpha"], dim=2), torch.stack(per_step["greedy"], dim=2)
    valid = (origin[None] + depth <= lengths[:, None] - 1) & (origin[None] + 2 >= loss_start[:, None])
    if document_ids is not None:
        # A chain ends inside its own document (documents are contiguous): near a document's end it read
        # the next one's first tokens and was trained against that document's soft labels.
        valid &= document_ids[:, :origins] == document_ids[:, (origin + depth).clamp(max=length - 1)]
    if objective == "lk":
        weights = valid[..., None].float() * position_decay(depth, device=device)
        loss = weighted_mean(torch.stack(per_step["loss"], dim=2), weights)
    else:
        loss = weighted_mean(end_to_end_tv_loss(alpha), valid.float())
    return ChainLoss(loss=loss, alpha=alpha.detach(), greedy_match=greedy_match, valid=valid,
                     draft_tokens=torch.stack(draft_tokens, dim=2))


def grow_mtp_layers(drafter, num_hidden_layers: int):
    """A copy of a trained EAGLE-3-style MTP drafter with plain decoder layers appended that start
    as the identity, so that it drafts exactly what ``drafter`` does and training continues with
    more capacity instead of from scratch.

    A new layer copies the last stacked layer, or, grown from one layer, the first layer's MLP and
    norms and the columns of its query/key/value projections that read the hidden stream (the
    first layer's attention reads ``[embedding; hidden]``); its attention output and MLP down
    projections are zeroed, so its residual branches add nothing until training moves them. A
    deepseek-style drafter, one MTP layer by definition, is refused by its config.
    """
    from ..modeling_angelspec_mtp import MTPDrafter

    grown, state = deeper_model(drafter, MTPDrafter, num_hidden_layers, "MTP")
    old, size = drafter.config.num_hidden_layers, drafter.config.hidden_size
    if old > 1:
        template = {key.split(".", 2)[2]: value for key, value in state.items() if key.startswith(f"layers.{old - 2}.")}
    else:
        template = {f"self_attn.{name}.weight": state[f"self_attn.{name}.weight"][:, size:] for name in ("q_proj", "k_proj", "v_proj")}
        template.update({"input_norm.weight": state["hidden_norm.weight"],
                         "post_attention_norm.weight": state["post_attention_norm.weight"],
                         "self_attn.o_proj.weight": state["self_attn.o_proj.weight"],
                         **{f"self_attn.{name}.weight": state[f"self_attn.{name}.weight"]
                            for name in ("q_norm", "k_norm") if f"self_attn.{name}.weight" in state},
                         **{f"mlp.{name}.weight": state[f"mlp.{name}.weight"] for name in ("gate_proj", "up_proj", "down_proj")}})
    for index in range(old - 1, num_hidden_layers - 1):
        state.update({f"layers.{index}.{name}": value.clone() for name, value in template.items()})
        state[f"layers.{index}.self_attn.o_proj.weight"] = torch.zeros_like(template["self_attn.o_proj.weight"])
        state[f"layers.{index}.mlp.down_proj.weight"] = torch.zeros_like(template["mlp.down_proj.weight"])
    grown.load_state_dict(state, strict=True)
    return grown.train(drafter.training)


def rewire_mtp_target_layers(drafter, target_layer_ids: list[int]):
    """A copy of a trained EAGLE-3-style MTP drafter that reads other target layers, starting from
    what it has learnt instead of from scratch.

    Only ``fc``, which fuses the concatenated target layers, changes shape. Each old layer's
    columns go to the new layer nearest to it (`nearest_layer_slots`): the residual stream changes
    little from one layer to the next, so a layer moved by one or two is still the input the fusion
    was trained on; new layers start with zero columns. A drafter whose layers all stay therefore
    drafts exactly as before until training moves the new columns. A deepseek-style drafter, which
    reads only the target's last layer, is refused by its config.
    """
    from ..modeling_angelspec_mtp import MTPDrafter

    if not isinstance(drafter, MTPDrafter):
        raise TypeError(f"this rewires MTP drafters; got {type(drafter).__name__}.")
    new_ids = [int(i) for i in target_layer_ids]
    if len(set(new_ids)) != len(new_ids):
        raise ValueError(f"target_layer_ids repeats a layer: {new_ids}.")
    config = type(drafter.config).from_dict({**drafter.config.to_dict(), "target_layer_ids": new_ids})
    rewired = MTPDrafter(config).to(device=drafter.device, dtype=drafter.dtype)
    state = drafter.state_dict()
    size = drafter.config.hidden_size
    old_fc = state["fc.weight"]
    fc = old_fc.new_zeros(size, len(new_ids) * size)
    for old_index, new_index in enumerate(nearest_layer_slots(drafter.config.target_layer_ids, new_ids)):
        fc[:, new_index * size:(new_index + 1) * size] += old_fc[:, old_index * size:(old_index + 1) * size]
    state["fc.weight"] = fc
    rewired.load_state_dict(state, strict=True)
    return rewired.train(drafter.training)


def nearest_layer_slots(old_ids: list[int], new_ids: list[int]) -> list[int]:
    """For each old layer, the index in ``new_ids`` that takes its fusion columns: the same layer
    when it stays, else the nearest new layer no old layer has taken yet (the nearest of all once
    every new layer is taken), the lower on a tie. Taken slots are avoided so that two old layers
    are not summed into one while a new layer next to one of them starts empty."""
    slots = {index: new_ids.index(layer) for index, layer in enumerate(old_ids) if layer in new_ids}
    for index, layer in enumerate(old_ids):
        if index in slots:
            continue
        free = [i for i in range(len(new_ids)) if i not in slots.values()] or list(range(len(new_ids)))
        slots[index] = min(free, key=lambda i: (abs(new_ids[i] - layer), new_ids[i]))
    return [slots[index] for index in range(len(old_ids))]
