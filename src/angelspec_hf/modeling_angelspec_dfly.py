"""AngelSpec DFly drafter: drafts a whole block in one forward (diffusion style).

The block is the anchor (last verified token) plus ``block_size - 1`` mask tokens embedded with
the target's embeddings. Each draft layer attends bidirectionally inside the block and to keys and
values built from target features of the committed context (never added to the residual stream).
Hybrid conditioning and the left-to-right hidden-correction head are config switches, so DFlash
(``conditioning="global"``, no correction) and DFlare (``"layerwise"``, no correction) are exact
special cases. Single-file style (torch, transformers, sibling modules) so it ships as remote code.
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from .configuration_angelspec_dfly import DFlyDrafterConfig
from .modeling_angelspec_common import (
    AngelSpecCandidateGenerator,
    AngelSpecPreTrainedModel,
    BatchedDraft,
    DraftLinear,
    RMSNorm,
    RowLinear,
    SwiGLU,
    VocabSubsetHead,
    apply_rotary,
    attend,
    derived_value,
    rotary_cos_sin,
    sorted_draft_token_ids,
    split_heads,
    stack_right_padded,
)

# Each drafter's gathered draft-vocabulary head and what it was gathered from (`DFlyDrafter.draft_head`);
# held outside the module so that copying or saving a drafter never meets it.
_DRAFT_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DFlyLayer(nn.Module):
    """Qwen3-style layer whose keys/values are ``[context; block]`` and queries the block only."""

    def __init__(self, config: DFlyDrafterConfig):
        super().__init__()
        size = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.rope_theta = config.rope_theta
        self.input_norm = RMSNorm(size, config.rms_norm_eps)
        self.q_proj = DraftLinear(size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = DraftLinear(size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = DraftLinear(size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = DraftLinear(self.num_heads * self.head_dim, size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.post_attention_norm = RMSNorm(size, config.rms_norm_eps)
        self.mlp = SwiGLU(size, config.intermediate_size, size)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        k = apply_rotary(self.k_norm(split_heads(self.k_proj(x), self.num_kv_heads, self.head_dim)), cos, sin)
        return k, split_heads(self.v_proj(x), self.num_kv_heads, self.head_dim)

    def forward(self, x, positions, context_kv, mask=None):
        """``x``: (batch, block, H); ``context_kv``: keys/values of the context from `keys_values`."""
        h = self.input_norm(x)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        q = apply_rotary(self.q_norm(split_heads(self.q_proj(h), self.num_heads, self.head_dim)), cos, sin)
        k, v = self.keys_values(h, positions)
        k = torch.cat([context_kv[0], k], dim=2)
        v = torch.cat([context_kv[1], v], dim=2)
        x = x + self.o_proj(attend(q, k, v, mask))
        return x + self.mlp(self.post_attention_norm(x))


class HiddenCorrection(nn.Module):
    """``z' = z + SwiGLU([RMSNorm(z); RMSNorm(e_prev)])`` (the second norm optional); the output
    projection starts at zero, so an untrained head is exactly DFlash."""

    def __init__(self, config: DFlyDrafterConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.correction_embed_norm else None
        self.mlp = SwiGLU(2 * config.hidden_size, config.correction_intermediate_size, config.hidden_size)
        self.mlp.down_proj.zero_init = True

    def forward(self, z: torch.Tensor, previous_embeds: torch.Tensor) -> torch.Tensor:
        if self.embed_norm is not None:
            previous_embeds = self.embed_norm(previous_embeds)
        return z + self.mlp(torch.cat([self.norm(z), previous_embeds], dim=-1))


class CorrectionSteps:
    """`HiddenCorrection` arranged for drafting one position after another (the same function).

    The input projections are split into the columns that read ``norm(z)``, applied to every
    position of the block in one product before the sequential loop, and those that read the
    previous token, applied per step; gate and up are fused. Why: each draft step is a chain of
    one-row products, whose cost on a CPU is mostly per call (measured on the reference target,
    Xeon with AMX, one thread, bfloat16: a DFly-Block8 round drafted in 10.6 ms, DFlash's in 3.9).
    Built once per generate call from the drafter's current weights.
    """

    def __init__(self, correction: HiddenCorrection):
        size = correction.norm.weight.shape[0]
        gate, up = correction.mlp.gate_proj.weight.detach(), correction.mlp.up_proj.weight.detach()
        self.context_product = RowLinear(torch.cat([gate[:, :size], up[:, :size]]).contiguous())
        self.token_product = RowLinear(torch.cat([gate[:, size:], up[:, size:]]).contiguous())
        self.down_product = RowLinear(correction.mlp.down_proj.weight.detach())
        self.norm, self.embed_norm = correction.norm, correction.embed_norm

    def prepare(self, z: torch.Tensor) -> torch.Tensor:
        """The ``norm(z)`` half of the gate and up projections for every position: (..., 2I)."""
        return self.context_product(self.norm(z))

    def step(self, z: torch.Tensor, prepared: torch.Tensor, previous_embeds: torch.Tensor) -> torch.Tensor:
        """Corrected ``z`` of one position for every row: (rows, H), given its `prepare` row."""
        if self.embed_norm is not None:
            previous_embeds = self.embed_norm(previous_embeds)
        gate, up = (prepared + self.token_product(previous_embeds)).chunk(2, dim=-1)
        return z + self.down_product(F.silu(gate) * up)


class DFlyDrafter(AngelSpecPreTrainedModel):
    """Block-parallel drafter with hybrid target conditioning and a hidden-correction head.

    Build one for a target with ``DFlyDrafter.from_target(target, block_size=8)``; use it with
    ``target.generate(**inputs, assistant_model=drafter)``.
    """

    config_class = DFlyDrafterConfig
    _no_split_modules = ["DFlyLayer"]

    def __init__(self, config: DFlyDrafterConfig):
        super().__init__(config)
        size, num_context = config.hidden_size, len(config.target_layer_ids)
        if config.conditioning in ("global", "hybrid"):
            self.context_proj = DraftLinear(num_context * size, size, bias=False)
        if config.conditioning in ("layerwise", "hybrid"):
            self.layer_fusion_weights = nn.Parameter(torch.zeros(config.num_hidden_layers, num_context))
        self.context_norm = RMSNorm(size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlyLayer(config) for _ in range(config.num_hidden_layers))
        self.hidden_correction = HiddenCorrection(config) if config.hidden_correction else None
        self.final_norm = RMSNorm(size, config.rms_norm_eps)
        if config.uses_reduced_vocab:
            # Target ids the drafter may propose; their rows of the target's lm_head score them.
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self and hasattr(self, "layer_fusion_weights"):
            # Zero logits = an even mix of the target layers.
            init.zeros_(self.layer_fusion_weights)

    @property
    def max_draft_tokens(self) -> int:
        return self.config.block_size - 1

    def contexts(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per draft layer, the context ``g(i)`` of each position from the target layers' features."""
        conditioning = self.config.conditioning
        fused = self.context_proj(torch.cat(features, dim=-1)) if conditioning != "layerwise" else None
        if conditioning == "global":
            return [self.context_norm(fused)] * len(self.layers)
        stacked = torch.stack(features, dim=-1)  # (batch, seq, H, num_context)
        mixes = torch.softmax(self.layer_fusion_weights.float(), dim=-1).to(stacked.dtype)
        per_layer = [stacked @ mixes[i] for i in range(len(self.layers))]
        if fused is not None:
            per_layer = [fused + mix for mix in per_layer]
        return [self.context_norm(context) for context in per_layer]

    def context_keys_values(self, features: list[torch.Tensor], positions: torch.Tensor):
        """Keys/values each draft layer keeps for the given committed positions."""
        return [layer.keys_values(context, positions) for layer, context in zip(self.layers, self.contexts(features))]

    def forward(self, block_embeds, positions, context_kv, attention_mask=None):
        """Backbone hidden states ``z`` of a block (before correction and final norm).

        Args:
            block_embeds: (batch, block, H) embeddings of the anchor and mask tokens.
            positions: (batch, block) absolute positions of the block.
            context_kv: per layer ``(keys, values)`` of the context, from `context_keys_values`.
            attention_mask: optional boolean (batch, 1, block, context + block).
        """
        x = block_embeds
        for layer, layer_kv in zip(self.layers, context_kv):
            x = layer(x, positions, layer_kv, attention_mask)
        return x

    def correct(self, z: torch.Tensor, previous_embeds: torch.Tensor) -> torch.Tensor:
        return z if self.hidden_correction is None else self.hidden_correction(z, previous_embeds)

    def logits(self, z: torch.Tensor, target_lm_head) -> torch.Tensor:
        """Logits of backbone/corrected states through ``target_lm_head`` or a `draft_head` of it."""
        return target_lm_head(self.final_norm(z).to(target_lm_head.weight.dtype))

    def vocab_logits(self, z: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Logits over the draft vocabulary only: its rows of ``target_lm_head`` (all rows without one).

        Training scores here: on a CPU the loss's passes over a 49k vocabulary cost more than the
        drafter itself, and drafting never proposes a token outside the draft vocabulary.
        """
        if not self.config.uses_reduced_vocab:
            return self.logits(z, target_lm_head)
        return self.draft_head(target_lm_head).subset_logits(self.final_norm(z).to(target_lm_head.weight.dtype))

    def draft_head(self, target_lm_head: nn.Module, dtype: torch.dtype | None = None):
        """The head drafting uses: the target's, or only its draft-vocabulary rows, those optionally
        copied in ``dtype`` (see `VocabSubsetHead`); the gathered rows are kept for the next call
        while the target's head weight (and bias, where it has one), the draft vocabulary and
        ``dtype`` stay the same.

        Why kept: every candidate generator asks for it, one per `generate` call and one per engine
        request and drafter, and the gather (4096 x 576 rows here) took 21 ms a request under cProfile
        in a concurrency-16 engine pass of the reference target (1.6-5 ms timed alone), whether the
        request ever drafted or not: 2% of that pass of the router over two block drafters, whose
        gates stayed shut throughout.

        A reduced vocabulary can also be set after training on the full one (`set_draft_vocab`).
        """
        if not self.config.uses_reduced_vocab:
            return target_lm_head
        weight, vocab = target_lm_head.weight, self.draft_vocab
        bias = getattr(target_lm_head, "bias", None)
        sources = (weight, vocab) if bias is None else (weight, vocab, bias)  # `VocabSubsetHead` gathers the bias too
        dtype = dtype or weight.dtype
        return derived_value(_DRAFT_HEADS, self, sources, dtype,
                             VocabSubsetHead, target_lm_head, vocab, self.config.vocab_size, dtype)

    def draft_logits(self, z: torch.Tensor, head) -> torch.Tensor:
        """Drafting's logits from a `draft_head`: over its draft-vocabulary columns for a reduced
        head (`BatchedDraft` maps the picks to target ids), else over the target vocabulary."""
        if isinstance(head, VocabSubsetHead):
            return head.subset_logits(self.final_norm(z))
        return self.logits(z, head)

    def draft_token_ids(self) -> torch.Tensor:
        """Target ids the drafter may propose (all of them without a reduced vocabulary)."""
        if not self.config.uses_reduced_vocab:
            return torch.arange(self.config.vocab_size, device=self.device)
        return self.draft_vocab

    def set_draft_vocab(self, token_ids) -> None:
        """Limit drafting to ``token_ids`` (for example the most frequent tokens of the training data)."""
        ids = sorted_draft_token_ids(token_ids, self.config.vocab_size)
        if ids.numel() >= self.config.vocab_size:
            if hasattr(self, "draft_vocab"):
                del self.draft_vocab
            self.config.draft_vocab_size = None
            return
        self.config.draft_vocab_size = ids.numel()
        self.register_buffer("draft_vocab", ids.to(self.final_norm.weight.device))

    @classmethod
    def from_target(
        cls, target: PreTrainedModel, block_size: int = 8, mask_token_id: int | None = None,
        draft_token_ids: list[int] | torch.Tensor | None = None, **overrides
    ) -> "DFlyDrafter":
        """A fresh (untrained) drafter sized and bound for ``target``.

        The mask token defaults to the target's ``unk_token_id`` when it is not also its
        BOS/EOS/PAD token, else to the last vocabulary id: any id the target does not emit works.
        ``draft_token_ids`` limits drafting to those target tokens (see `set_draft_vocab`).
        """
        if mask_token_id is None:
            mask_token_id = default_mask_token_id(target)
        overrides.setdefault("correction_embed_norm", True)
        config = cls.config_from_target(target, block_size=block_size, mask_token_id=mask_token_id, **overrides)
        drafter = cls(config).to(device=target.device)
        if draft_token_ids is not None:
            drafter.set_draft_vocab(draft_token_ids)
        return drafter


def default_mask_token_id(target: PreTrainedModel) -> int:
    text = target.config.get_text_config()
    special = set()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(text, name, None)
        special.update(value if isinstance(value, list) else [value])
    unk = getattr(text, "unk_token_id", None)
    if isinstance(unk, int) and unk not in special:
        return unk
    return text.vocab_size - 1


class DFlyCandidateGenerator(AngelSpecCandidateGenerator):
    """Keeps per-layer context keys/values of committed positions; drafts one block per round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.draft_lm_head = self.drafter.draft_head(self.lm_head, dtype=self.drafter.dtype)
        correction = self.drafter.hidden_correction
        self.correction_steps = CorrectionSteps(correction) if correction is not None else None

    def ingest(self, input_ids, features):
        self.ingest_many([self], [input_ids], [features])

    @classmethod
    def ingest_many(cls, generators, input_ids, features):
        """Context keys/values depend on each position alone, so all rows' new positions go through
        the drafter as one sequence and are split back."""
        counts = [row[0].shape[1] for row in features]
        positions = torch.cat([torch.arange(generator.committed, generator.committed + count, device=ids.device)
                               for generator, ids, count in zip(generators, input_ids, counts)])[None]
        joined = [torch.cat(layer, dim=1) for layer in zip(*features)]
        new = generators[0].drafter.context_keys_values(joined, positions)
        for generator, parts in zip(generators, zip(*[zip(k.split(counts, dim=2), v.split(counts, dim=2)) for k, v in new])):
            generator._append_context(list(parts))

    def _append_context(self, new: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.context_kv is None:
            self.context_kv = new
        else:
            self.context_kv = [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(self.context_kv, new)
            ]

    def draft(self, input_ids, num_tokens):
        return self.draft_many([self], [input_ids], [num_tokens])[0]

    @classmethod
    def draft_many(cls, generators, input_ids, budgets):
        """One block forward for all rows (one row: `draft`): contexts stacked right-padded under a
        key mask; the correction head then runs left to right over every row at once."""
        first = generators[0]
        drafter, config = first.drafter, first.drafter.config
        rows, block = len(generators), config.block_size
        device = input_ids[0].device
        lengths = [generator.context_kv[0][0].shape[2] for generator in generators]
        context_kv = [
            tuple(stack_right_padded([generator.context_kv[layer][part] for generator in generators], dim=2)
                  for part in range(2))
            for layer in range(len(drafter.layers))
        ]
        context_mask = cls.stacked_context_mask(generators, lengths)
        mask = torch.cat([context_mask, context_mask.new_ones(rows, 1, 1, block)], dim=-1)
        anchors = torch.cat([ids[:, -1:] for ids in input_ids])
        block_ids = torch.cat([anchors, anchors.new_full((rows, block - 1), config.mask_token_id)], dim=-1)
        starts = torch.tensor([ids.shape[1] - 1 for ids in input_ids], device=device)
        positions = starts[:, None] + torch.arange(block, device=device)[None]
        num_tokens = max(budgets)
        z = drafter(first.embed_tokens(block_ids).to(drafter.dtype), positions, context_kv, mask)[:, 1 : num_tokens + 1]
        # Without the correction head every position's logits are known at once: one lm_head call
        # (the head is memory-bound, so k rows cost about what one row does).
        head, correction = first.draft_lm_head, first.correction_steps
        logits_all = drafter.draft_logits(z, head) if correction is None else None
        prepared = correction.prepare(z) if correction is not None else None
        token_ids = head.token_ids if isinstance(head, VocabSubsetHead) else None
        draft, previous = BatchedDraft(generators, input_ids, budgets, token_ids), anchors
        for index in range(num_tokens):
            if logits_all is None:
                hidden = correction.step(z[:, index], prepared[:, index],
                                         first.embed_tokens(previous).to(drafter.dtype)[:, 0])
                position_logits = drafter.draft_logits(hidden, head)
            else:
                position_logits = logits_all[:, index]
            # Without the correction head all positions are scored at once, so the policy is not asked.
            previous = draft.choose(position_logits, index, ask_policy=logits_all is None)
            if draft.done:
                break
        return draft.results()

DFlyDrafter.candidate_generator_class = DFlyCandidateGenerator
DFlyDrafterConfig.register_for_auto_class()
DFlyDrafter.register_for_auto_class("AutoModel")
