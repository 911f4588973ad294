"""AngelSpec MTP drafter: one decoder layer (EAGLE-3 or DeepSeek-V3 MTP style), drafting token by token,
optionally followed by further plain decoder layers (EAGLE-3 style, ``num_hidden_layers`` > 1).

Input at target position t: the fused target feature (or, once the draft runs ahead of the
target, the drafter's own previous hidden state) and the embedding of token t+1; output: the
token at t+2. Single-file style (torch, transformers, sibling modules) so it ships as remote code.
"""

import torch
from torch import nn
from transformers import PreTrainedModel

from .configuration_angelspec_mtp import MTPDrafterConfig
from .modeling_angelspec_common import (
    AngelSpecCandidateGenerator,
    AngelSpecPreTrainedModel,
    BatchedDraft,
    DraftLinear,
    RMSNorm,
    SwiGLU,
    apply_rotary,
    attend,
    expand_to_vocab,
    rotary_cos_sin,
    sorted_draft_token_ids,
    split_heads,
    stack_right_padded,
)


class MTPAttention(nn.Module):
    """Self-attention of the MTP layer: over ``[norm(embedding); norm(hidden)]`` (2H wide) in the
    EAGLE-3 style, over the fused H-wide input in the DeepSeek style, with optional QK-norm."""

    def __init__(self, config: MTPDrafterConfig, width: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.rope_theta = config.rope_theta
        if width is None:
            width = config.hidden_size * (2 if config.layer_style == "eagle3" else 1)
        self.q_proj = DraftLinear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = DraftLinear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = DraftLinear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = DraftLinear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """Rotated queries and keys, and values, as (batch, heads, seq, head_dim)."""
        rotary = self.rotary(positions, x.dtype)
        return self.queries(x, rotary), *self.keys_values(x, rotary)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(positions, self.head_dim, self.rope_theta, dtype)

    def queries(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q = split_heads(self.q_proj(x), self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rotary(q, *rotary)

    def keys_values(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k = split_heads(self.k_proj(x), self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, *rotary), split_heads(self.v_proj(x), self.num_kv_heads, self.head_dim)

    def forward(self, x, positions, past_key_values=None, mask=None, queries: torch.Tensor | None = None):
        """Returns the attention output and the keys/values including ``past_key_values``.

        ``queries`` (one sequence index per row) limits the output to those positions: (batch, 1, H).
        Every position's keys and values are still returned."""
        rotary = self.rotary(positions, x.dtype)
        k, v = self.keys_values(x, rotary)
        if queries is None:
            q = self.queries(x, rotary)
        else:
            q = self.queries(select_positions(x, queries), self.rotary(select_positions(positions, queries), x.dtype))
            mask = None if mask is None else mask.gather(
                2, queries[:, None, None, None].expand(-1, mask.shape[1], 1, mask.shape[3]))
        if past_key_values is not None:
            k = torch.cat([past_key_values[0], k], dim=2)
            v = torch.cat([past_key_values[1], v], dim=2)
        return self.o_proj(attend(q, k, v, mask)), (k, v)


def select_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Position ``index[row]`` of every row of a (batch, seq, ...) tensor, kept as (batch, 1, ...)."""
    return x[torch.arange(x.shape[0], device=x.device), index][:, None]


class MTPDecoderLayer(nn.Module):
    """A plain pre-norm decoder layer stacked on the MTP layer (``num_hidden_layers`` > 1): it
    reads the hidden stream only, so all the target conditioning stays in the first layer and a
    drafter grown from a one-layer one keeps its weights and state-dict names."""

    def __init__(self, config: MTPDrafterConfig):
        super().__init__()
        size = config.hidden_size
        self.input_norm = RMSNorm(size, config.rms_norm_eps)
        self.self_attn = MTPAttention(config, width=size)
        self.post_attention_norm = RMSNorm(size, config.rms_norm_eps)
        self.mlp = SwiGLU(size, config.intermediate_size, size)

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_norm(hidden))


class MTPDrafter(AngelSpecPreTrainedModel):
    """Autoregressive MTP drafter, trained with training-time test (see DESIGN.md).

    Build one for a target with ``MTPDrafter.from_target(target)``; use it with
    ``target.generate(**inputs, assistant_model=drafter)``.
    """

    config_class = MTPDrafterConfig
    _no_split_modules = ["MTPAttention", "MTPDecoderLayer"]

    def __init__(self, config: MTPDrafterConfig):
        super().__init__(config)
        size = config.hidden_size
        self.deepseek_style = config.layer_style == "deepseek"
        if self.deepseek_style:
            self.eh_proj = DraftLinear(2 * size, size, bias=False)
            self.attention_norm = RMSNorm(size, config.rms_norm_eps)
        else:
            self.fc = DraftLinear(len(config.target_layer_ids) * size, size, bias=False)
        self.input_norm = RMSNorm(size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(size, config.rms_norm_eps)
        self.self_attn = MTPAttention(config)
        self.post_attention_norm = RMSNorm(size, config.rms_norm_eps)
        self.mlp = SwiGLU(size, config.intermediate_size, size)
        # Empty for the one-layer drafter, so its checkpoints keep exactly their tensors.
        self.layers = nn.ModuleList(MTPDecoderLayer(config) for _ in range(config.num_hidden_layers - 1))
        self.norm = RMSNorm(size, config.rms_norm_eps)
        if config.uses_reduced_vocab:
            self.lm_head = DraftLinear(size, config.draft_vocab_size, bias=False)
            # EAGLE-3 layout: target id = draft id + d2t[draft id]; t2d marks target ids in the draft vocab.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.lm_head = None
        self.post_init()

    @property
    def max_draft_tokens(self) -> int:
        return self.config.num_draft_tokens

    def fuse(self, features: list[torch.Tensor]) -> torch.Tensor:
        """The drafter's view of the target: the concatenated layers projected to its width
        (EAGLE-3 style), or the target's final hidden state itself (DeepSeek style)."""
        if self.deepseek_style:
            return features[0]
        return self.fc(torch.cat(features, dim=-1))

    def attention_input(self, hidden: torch.Tensor, input_embeds: torch.Tensor, positions: torch.Tensor):
        """``(residual, x)``: the layer's residual stream and its attention input."""
        if self.deepseek_style:
            # DeepSeek/Hy3 MTP training zeroes the embedding at position 0 (the first token has no context).
            input_embeds = input_embeds.masked_fill((positions == 0)[..., None], 0.0)
            residual = self.eh_proj(torch.cat([self.input_norm(input_embeds), self.hidden_norm(hidden)], dim=-1))
            return residual, self.attention_norm(residual)
        return hidden, torch.cat([self.input_norm(input_embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output after attention: the hidden state the next draft step reads."""
        hidden = residual + attn
        hidden = hidden + self.mlp(self.post_attention_norm(hidden))
        # The DeepSeek layer feeds its final-normed output forward, so the norm belongs to the step.
        return self.norm(hidden) if self.deepseek_style else hidden

    def decode(self, hidden: torch.Tensor, input_embeds: torch.Tensor, positions: torch.Tensor, attention,
               keep: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step through every layer; ``attention(layer, attention_module, x)`` computes
        each layer's attention output, so that inference (with a KV cache) and training (with the
        unrolled chain's keys, training/mtp.py) share one definition of the layer stack.

        ``keep`` (one sequence index per row) returns the step's output at those positions only,
        (batch, 1, H): the last layer then attends from them alone (``attention(..., queries=keep)``)
        and runs its MLP on them alone, while every layer still writes every position's keys. Why:
        ingesting committed positions needs their keys and the last one's output only; the last
        layer's queries, output projection and MLP are most of a one-layer drafter's cost a position
        (on the reference target's MTP drafter about 70% of the multiply-adds)."""
        last = len(self.layers)

        def layer_step(index: int, module: MTPAttention, finish, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            if index == last and keep is not None:
                return finish(select_positions(residual, keep), attention(index, module, x, queries=keep))
            return finish(residual, attention(index, module, x))

        residual, x = self.attention_input(hidden, input_embeds, positions)
        hidden = layer_step(0, self.self_attn, self.finish, residual, x)
        for index, layer in enumerate(self.layers, start=1):
            hidden = layer_step(index, layer.self_attn, layer.finish, hidden, layer.input_norm(hidden))
        return hidden

    def forward(self, hidden, input_embeds, positions, past_key_values=None, attention_mask=None,
                keep: torch.Tensor | None = None):
        """One decoder step for a chunk of positions.

        Args:
            hidden: (batch, seq, H) fused target features or the drafter's own previous outputs.
            input_embeds: (batch, seq, H) embeddings of the next tokens.
            positions: (batch, seq) absolute positions.
            past_key_values: optional ``(keys, values)`` of earlier positions, per layer in turn
                (``(keys_0, values_0, keys_1, values_1, ...)``).
            attention_mask: optional boolean (batch, 1, seq, past + seq), True where attention is allowed.
            keep: optional (batch,) sequence index per row: ``hidden_out`` only there, (batch, 1, H)
                (see `decode`); ``present`` is the same either way.
        Returns:
            ``(hidden_out, present)``: ``hidden_out`` feeds ``logits`` and the next step; ``present``
            the keys and values including the past ones, laid out as ``past_key_values``.
        """
        present: list[torch.Tensor] = []

        def attention(layer: int, module: MTPAttention, x: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
            past = None if past_key_values is None else past_key_values[2 * layer : 2 * layer + 2]
            out, keys_values = module(x, positions, past, attention_mask, queries)
            present.extend(keys_values)
            return out

        return self.decode(hidden, input_embeds, positions, attention, keep), tuple(present)

    def draft_token_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, in draft-vocabulary order."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    draft_vocabulary_tensor = "d2t (target id = draft id + d2t)"

    def draft_vocabulary_problems(self) -> list[str]:
        """Also ``t2d``: drafting never reads it, but an EAGLE-3 export ships it, and a reader that
        trusts it over ``d2t`` would draft other tokens."""
        problems = super().draft_vocabulary_problems()
        if not problems:
            expected = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.t2d.device)
            expected[self.draft_token_ids()] = True
            if self.t2d.shape != expected.shape or not torch.equal(self.t2d.bool(), expected):
                problems.append("t2d does not mark exactly the target ids that d2t maps to")
        return problems

    def vocab_logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Logits over the drafter's own vocabulary: the reduced one if it has one, else the target's."""
        normed = hidden if self.deepseek_style else self.norm(hidden)
        if self.lm_head is None:
            return target_lm_head(normed.to(target_lm_head.weight.dtype))
        return self.lm_head(normed)

    def logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Logits over the target vocabulary; tokens outside a reduced draft vocabulary get -inf."""
        draft = self.vocab_logits(hidden, target_lm_head)
        if self.lm_head is None:
            return draft
        return expand_to_vocab(draft, self.draft_token_ids(), self.config.vocab_size)

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        num_draft_tokens: int = 3,
        draft_vocab_size: int | None = None,
        draft_token_ids: list[int] | torch.Tensor | None = None,
        **overrides,
    ) -> "MTPDrafter":
        """A fresh (untrained) drafter sized and bound for ``target``.

        A reduced draft vocabulary is given by ``draft_token_ids`` (for example the most frequent
        tokens of the training data) or, with only ``draft_vocab_size``, the lowest ids (BPE
        vocabularies put frequent merges first). Its ``lm_head`` starts from the target's rows.
        """
        if draft_token_ids is not None:
            vocab_size = target.config.get_text_config().vocab_size
            draft_token_ids = sorted_draft_token_ids(draft_token_ids, vocab_size, draft_vocab_size)
            draft_vocab_size = draft_token_ids.numel()
        config = cls.config_from_target(
            target, num_draft_tokens=num_draft_tokens, ttt_steps=overrides.pop("ttt_steps", num_draft_tokens),
            draft_vocab_size=draft_vocab_size, **overrides,
        )
        drafter = cls(config).to(device=target.device)
        if config.uses_reduced_vocab:
            ids = draft_token_ids if draft_token_ids is not None else torch.arange(draft_vocab_size)
            drafter.set_draft_vocab(ids.to(target.device), target.get_output_embeddings().weight)
        return drafter

    def set_draft_vocab(self, token_ids: torch.Tensor, target_lm_head_weight: torch.Tensor | None = None) -> None:
        """Fill ``d2t``/``t2d`` from sorted target ids and, optionally, copy their ``lm_head`` rows."""
        with torch.no_grad():
            self.d2t.copy_(token_ids - torch.arange(token_ids.numel(), device=token_ids.device))
            self.t2d.zero_()
            self.t2d[token_ids] = True
            if target_lm_head_weight is not None:
                self.lm_head.weight.copy_(target_lm_head_weight[token_ids].to(self.lm_head.weight.dtype))


class MTPCandidateGenerator(AngelSpecCandidateGenerator):
    """Keeps the drafter's KV cache of committed positions (from target features); drafts step by step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.past: tuple[torch.Tensor, ...] | None = None  # keys and values of every layer in turn
        self.last_hidden: torch.Tensor | None = None

    def ingest(self, input_ids, features):
        self.ingest_many([self], [input_ids], [features])

    @classmethod
    def ingest_many(cls, generators, input_ids, features):
        """One drafter forward over every row's new positions, right-padded to the longest: each
        query sees its row's cache (stacked under a key mask) and its row's new keys causally."""
        first = generators[0]
        drafter = first.drafter
        counts = [row[0].shape[1] for row in features]
        width, device = max(counts), input_ids[0].device
        fused = stack_right_padded([drafter.fuse(row) for row in features], dim=1)
        tokens = stack_right_padded([ids[:, g.committed + 1 : g.committed + 1 + n]
                                     for g, ids, n in zip(generators, input_ids, counts)], dim=1)
        starts = torch.tensor([generator.committed for generator in generators], device=device)
        positions = starts[:, None] + torch.arange(width, device=device)[None]
        lengths = [generator.past[0].shape[2] if generator.past is not None else 0 for generator in generators]
        if max(lengths):
            past = tuple(stack_right_padded([g.past[part] if g.past is not None else g._empty_past(part)
                                             for g in generators], dim=2) for part in range(first.cache_parts))
            context_mask = cls.stacked_context_mask(generators, lengths).expand(-1, -1, width, -1)
        else:
            past, context_mask = None, torch.ones(len(generators), 1, width, 0, dtype=torch.bool, device=device)
        new_keys = torch.arange(width, device=device)
        real = new_keys[None] < torch.tensor(counts, device=device)[:, None]  # (rows, width)
        for row, generator in enumerate(generators):
            if generator.key_padding is not None:  # a left-padded prompt's padding is among the new keys
                real[row, : counts[row]] &= generator.key_padding[0, generator.committed : generator.committed + counts[row]]
        causal = new_keys[None, :] <= new_keys[:, None]
        mask = torch.cat([context_mask, (causal[None] & real[:, None, :])[:, None]], dim=-1)
        # Drafting reads the new positions' keys and the last one's output only (`MTPDrafter.decode`).
        last = torch.tensor(counts, device=device) - 1
        hidden, present = drafter(fused, first._embed(tokens), positions, past, mask, keep=last)
        context = max(lengths)
        for row, (generator, count) in enumerate(zip(generators, counts)):
            new = tuple(part[row : row + 1, :, context : context + count] for part in present)
            generator.past = new if generator.past is None else tuple(
                torch.cat([old, part], dim=2) for old, part in zip(generator.past, new))
            generator.last_hidden = hidden[row : row + 1]

    @property
    def cache_parts(self) -> int:
        """Tensors in a cache: keys and values per layer."""
        return 2 * self.drafter.config.num_hidden_layers

    def _empty_past(self, part: int) -> torch.Tensor:
        """A zero-length cache entry shaped like this drafter's keys (rows that have none yet)."""
        attention = self.drafter.self_attn
        return self.embed_tokens.weight.new_zeros(1, attention.num_kv_heads, 0, attention.head_dim).to(self.drafter.dtype)

    def draft(self, input_ids, num_tokens):
        return self.draft_many([self], [input_ids], [num_tokens])[0]

    @classmethod
    def draft_many(cls, generators, input_ids, budgets):
        """Each draft step runs once for all rows (one row: `draft`), over their caches stacked
        right-padded under a key mask. The draft steps' own entries live only in the stacked copy:
        a row's cache holds exactly its committed positions, which the target has verified."""
        first = generators[0]
        drafter = first.drafter
        rows = len(generators)
        lengths = [generator.past[0].shape[2] for generator in generators]
        past = tuple(stack_right_padded([generator.past[part] for generator in generators], dim=2)
                     for part in range(first.cache_parts))
        context_mask = cls.stacked_context_mask(generators, lengths)
        hidden = torch.cat([generator.last_hidden for generator in generators])
        # The last ingested origin sits at position len - 2 (its feature's), and draft step k plays
        # origin len - 2 + k, as in training (training/mtp.py); len - 1 put every step one position
        # late, which the shipped drafter's chains then drafted differently (7 of 85 on MT-Bench rows).
        positions = torch.tensor([[ids.shape[1] - 2] for ids in input_ids], device=input_ids[0].device)
        # A reduced head's picks are made over its own columns and mapped to target ids.
        token_ids = drafter.draft_token_ids() if drafter.lm_head is not None else None
        draft, previous = BatchedDraft(generators, input_ids, budgets, token_ids), None
        for step in range(max(budgets)):
            if step:
                mask = torch.cat([context_mask, context_mask.new_ones(rows, 1, 1, step)], dim=-1)
                hidden, past = drafter(hidden, first._embed(previous), positions + step, past, mask)
            previous = draft.choose(drafter.vocab_logits(hidden[:, -1], first.lm_head), step)
            if draft.done:
                break
        return draft.results()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens).to(self.drafter.dtype)


MTPDrafter.candidate_generator_class = MTPCandidateGenerator
MTPDrafterConfig.register_for_auto_class()
MTPDrafter.register_for_auto_class("AutoModel")
