"""Exact verification in reduced precision: every position gets the same bits whether the target
computes it alone (plain decoding) or among the k+1 positions of a verify forward.

Speculative decoding is lossless only if the verify forward scores each drafted position exactly
as plain decoding would. In float32 the kernels for one row and for several differ in the last bits
and a greedy choice practically never flips; in bfloat16 the differences survive rounding and do
flip (measured on the reference target, stock kernels: every row of a 9-token verify differed from
plain decoding in its logits). Two things differ, both in the order of floating-point sums:

- attention: a fused kernel reduces one query row's scores differently from a block of rows;
- matrix multiplies: a BLAS may take a matrix-vector path for one row (oneDNN bf16 on an AMD
  CPU, inner size 1536: 378 of 2.3M outputs differed) and blocked paths above some row count.

`make_verification_exact` installs an attention (`exact_attention`) whose per-row result does not
depend on the other rows or on how many keys follow (scores and weighted values computed over
fixed 64-key blocks, summed block by block in order, masked keys contributing exact zeros), and
routes every ``nn.Linear`` whose probe shows row-count dependence through the row counts that
agree (one row is computed as two; blocks above the largest agreeing count are split). It then
checks the whole target: plain decoding against verify forwards of every width up to
``max_rows``, bit for bit, and raises `ExactVerificationError` naming what still differs.

Why bfloat16 is worth this on a CPU: its GEMMs cost about the same for 1 to 16 rows, float32's
(MKL) cost up to twice as much for a few rows as for one, so a verify forward is nearly free in
bfloat16 (reference target, one thread, context 300: 1 new token 54 ms, 9 new tokens 67 ms;
float32 two threads: 59 ms and about 100 ms).
"""

from __future__ import annotations

import logging
import math
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import ExactVerificationError

logger = logging.getLogger(__name__)

ATTENTION_NAME = "angelspec_exact"
KEY_BLOCK = 64  # keys per block: a block's partial sums never depend on how many blocks follow
_SCORE_ELEMENTS = 1 << 22  # a prefill is attended in chunks of at most this many fp32 scores


# --------------------------------------------------------------------------- attention


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention whose output for a query row is the same bits for any number
    of other query rows and any number of keys after the ones it sees (``AttentionInterface``
    form: query ``(b, heads, q, d)``, key/value ``(b, kv_heads, k, d)``, returns ``(b, q, heads, d)``).

    Every product over keys is taken over fixed ``KEY_BLOCK``-key blocks, added block by block in
    order, so keys beyond what a row sees add exact zeros; a single query row is computed as two
    (a one-row product may take a matrix-vector path that sums in another order). That the
    products' results for a row do not depend on how many rows they hold is the BLAS's property,
    checked on the whole target by `check_verification_exact` when `make_verification_exact` runs.
    """
    for unsupported in ("softcap", "s_aux", "position_bias", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise ExactVerificationError(f"exact verification's attention does not support `{unsupported}`; "
                                         "use the target's own attention (do not call make_verification_exact).")
    if dropout and module.training:
        raise ExactVerificationError("exact verification's attention has no dropout: call `.undo()` on what "
                                     "make_verification_exact returned before training the target.")
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads or value.shape[-1] != dim:
        raise ExactVerificationError(f"exact verification's attention needs query heads ({heads}) a multiple of "
                                     f"key heads ({kv_heads}) and equal key/value head sizes.")
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    keys, values = _blocked_keys(key, value)
    padded = keys.shape[1]
    out = torch.empty(batch, q_len, heads, dim, dtype=query.dtype, device=query.device)
    chunk = max(2, _SCORE_ELEMENTS // (heads * padded * batch))
    # Its many small operations each wake the other OpenMP threads (PASSIVE waiting): on one thread
    # the attention of a decoding step costs less than that wake-up.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for start in range(0, q_len, chunk):
            stop = min(q_len, start + chunk)
            bias = _row_bias(attention_mask, batch, q_len, kv_len, padded, causal, start, stop, kv_heads, groups)
            _attend(query[:, :, start:stop], keys, values, bias, scale, out[:, start:stop])
    finally:
        torch.set_num_threads(threads)
    return out, None


def _blocked_keys(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys ``(b*kv_heads, padded, d)`` and values with a column of ones appended (its
    weighted sum is the softmax denominator, summed in the same order as the values), zero-padded
    to whole key blocks."""
    batch, kv_heads, kv_len, dim = key.shape
    padded = -(-kv_len // KEY_BLOCK) * KEY_BLOCK
    n = batch * kv_heads
    keys = torch.empty(n, padded, dim, dtype=torch.float32, device=key.device)
    keys[:, :kv_len].copy_(key.reshape(n, kv_len, dim))
    keys[:, kv_len:].zero_()
    values = torch.empty(n, padded, dim + 1, dtype=torch.float32, device=key.device)
    values[:, :kv_len, :dim].copy_(value.reshape(n, kv_len, dim))
    values[:, kv_len:, :dim].zero_()
    values[:, :, dim].fill_(1.0)
    return keys, values


_bias_cache: dict = {}


def _row_bias(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, padded: int, causal: bool,
              start: int, stop: int, kv_heads: int, groups: int) -> torch.Tensor:
    """Additive float32 mask of query rows ``start:stop`` as ``(b*kv_heads, groups*rows, padded)``
    (rows = max(stop - start, 2), extra rows copies of the first): 0 where a row sees a key, -inf
    elsewhere, padding keys included. Every layer of a forward gets the same mask object, so a
    decoding or verify forward's (one chunk) is built once per forward; a long prefill's chunks
    are built per layer, not kept."""
    # The mask's version too: one updated in place between forwards is the same object.
    shape = (batch, q_len, kv_len, padded, causal, kv_heads, groups,
             None if attention_mask is None else (tuple(attention_mask.shape), attention_mask._version))
    if _bias_cache.get("shape") != shape or _bias_cache.get("mask") is not attention_mask:
        _bias_cache.clear()
        _bias_cache.update(shape=shape, mask=attention_mask)
    if (start, stop) in _bias_cache:
        return _bias_cache[(start, stop)]
    device = attention_mask.device if attention_mask is not None else None
    if attention_mask is None:
        positions = torch.arange(padded, device=device)
        if causal and q_len > 1:
            last_seen = kv_len - q_len + torch.arange(start, stop, device=device)
        else:
            last_seen = torch.full((stop - start,), kv_len - 1, device=device)
        visible = (positions[None, :] <= last_seen[:, None]).expand(batch, stop - start, padded)
    else:
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            raise ExactVerificationError(f"exact verification's attention takes masks of shape (batch, 1, query, key), "
                                         f"got {tuple(attention_mask.shape)}.")
        mask = attention_mask[:, 0, attention_mask.shape[2] - q_len:, :kv_len][:, start:stop]
        mask = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        visible = F.pad(mask, (0, padded - kv_len), value=False).expand(batch, stop - start, padded)
    if stop - start == 1:
        visible = visible.expand(batch, 2, padded)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))
    rows = bias.shape[1]
    bias = bias[:, None, None].expand(batch, kv_heads, groups, rows, padded).reshape(batch * kv_heads, groups * rows, padded)
    if (start, stop) == (0, q_len):
        _bias_cache[(start, stop)] = bias
    return bias


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float,
            out: torch.Tensor) -> None:
    """Attention of query rows ``(b, heads, r, d)`` into ``out`` ``(b, r, heads, d)``."""
    batch, heads, r, dim = query.shape
    n, padded = keys.shape[0], keys.shape[1]
    groups, rows = heads // (n // batch), max(r, 2)
    blocks = padded // KEY_BLOCK
    m = groups * rows
    q = query.reshape(n, groups, r, dim).float()
    if rows > r:
        q = q.expand(n, groups, rows, dim)
    scores = torch.baddbmm(bias, q.reshape(n, m, dim), keys.transpose(1, 2), alpha=scale)
    # A row that sees no key at all (a padded query) gets weights 0 and output 0, not NaN.
    peak = scores.amax(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).min)
    weights = scores.sub_(peak).exp_()
    by_block = weights.view(n, m, blocks, KEY_BLOCK).transpose(1, 2).reshape(n * blocks, m, KEY_BLOCK)
    partial = torch.bmm(by_block, values.view(n * blocks, KEY_BLOCK, dim + 1))
    # cumsum adds the blocks strictly in order, so blocks of masked keys (exact zeros) change nothing.
    total = partial.view(n, blocks, m, dim + 1).cumsum(1)[:, -1]
    result = total[..., :dim].div_(total[..., dim:].clamp_min(torch.finfo(torch.float32).tiny))
    result = result.view(batch, n // batch, groups, rows, dim)[:, :, :, :r]
    out.view(batch, r, n // batch, groups, dim).copy_(result.permute(0, 3, 1, 2, 4))


def register_exact_attention() -> None:
    """Make ``ATTENTION_NAME`` a valid ``attn_implementation`` (masks as for ``sdpa``). Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, exact_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# --------------------------------------------------------------------------- linear layers


@dataclass(frozen=True)
class RowPlan:
    """How a linear layer's inputs of up to ``max_rows`` rows are computed so that each row's
    output has the same bits for every row count: ``pad_single`` computes one row as two, and
    blocks of more than ``largest_block`` rows are split into blocks of that many."""

    pad_single: bool
    largest_block: int

    def needed(self, max_rows: int) -> bool:
        return self.pad_single or self.largest_block < max_rows


_PROBE_OUTPUTS = 1 << 21


def plan_linear(weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int, samples: int | None = None,
                seed: int = 0) -> RowPlan:
    """Probe ``F.linear`` with this weight on random rows: which row counts give each row the same bits.

    A different summation order shows in a bfloat16 output only when it crosses a rounding
    boundary (on the reference target 378 of 2.3M outputs of the layer that differs), so the probe
    looks at about 2M outputs (``samples`` rows; at least 4 blocks of every row count).
    """
    if samples is None:
        samples = min(8192, max(4 * max_rows, _PROBE_OUTPUTS // weight.shape[0]))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(samples, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        single = torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(samples)])
        paired = torch.cat([F.linear(torch.cat([x[i:i + 1], x[i:i + 1]]), weight, bias)[:1] for i in range(samples)])
        largest = 1
        for rows in range(2, max_rows + 1):
            usable = samples - samples % rows
            blocked = torch.cat([F.linear(x[s:s + rows], weight, bias) for s in range(0, usable, rows)])
            if not torch.equal(blocked, paired[:usable]):
                break
            largest = rows
    if largest < 2:
        raise ExactVerificationError(
            f"a linear layer of shape {tuple(weight.shape)} in {weight.dtype} gives a row different bits "
            "beside another row than beside a copy of itself on this hardware, so no row count is safe; "
            "run the target in float32 (its verification is token-identical in practice) instead.")
    return RowPlan(pad_single=not torch.equal(single, paired), largest_block=largest)


def _row_stable_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through the row counts of ``self._angelspec_row_plan`` (bound per module
    as a method, so that ``copy.deepcopy`` of the model binds the copy's own weights)."""
    plan, max_rows = self._angelspec_row_plan
    rows = math.prod(x.shape[:-1])
    if rows > max_rows or (rows <= plan.largest_block and not (rows == 1 and plan.pad_single)):
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    parts = []
    for start in range(0, rows, plan.largest_block):
        part = flat[start:start + plan.largest_block]
        if part.shape[0] == 1 and plan.pad_single:
            parts.append(F.linear(torch.cat([part, part]), self.weight, self.bias)[:1])
        else:
            parts.append(F.linear(part, self.weight, self.bias))
    return torch.cat(parts).view(*x.shape[:-1], -1)


# --------------------------------------------------------------------------- the whole target


@dataclass
class ExactVerification:
    """What `make_verification_exact` changed on a target; ``undo()`` restores it."""

    target: torch.nn.Module
    max_rows: int
    previous_attention: str
    plans: dict[str, RowPlan] = field(default_factory=dict)  # module name -> plan, for rerouted layers only

    def undo(self) -> None:
        modules = dict(self.target.named_modules())
        for name in self.plans:
            modules[name].__dict__.pop("forward", None)
            modules[name].__dict__.pop("_angelspec_row_plan", None)
        self.target.set_attn_implementation(self.previous_attention)
        self.target._angelspec_exact = None


def is_verification_exact(target: torch.nn.Module) -> bool:
    return getattr(target, "_angelspec_exact", None) is not None


def make_verification_exact(target, max_rows: int = 16, check: bool = True) -> ExactVerification:
    """Make ``target``'s forward give each position the same bits computed alone or among up to
    ``max_rows`` new positions, so that speculative decoding is token-identical to plain decoding
    in bfloat16 (or any dtype). Plain ``target.generate`` uses the same kernels afterwards.

    Verify forwards wider than ``max_rows`` tokens (and prefills) run unchanged. With ``check`` the
    whole target is verified bit for bit (`check_verification_exact`; probing and checking took
    8-11 s on the 135M reference target); a failure undoes the change and raises
    `ExactVerificationError`. Idempotent.
    """
    if is_verification_exact(target):
        return target._angelspec_exact
    if max_rows < 2:
        raise ValueError(f"max_rows must be at least 2 (one decoded token plus one draft), got {max_rows}.")
    register_exact_attention()
    state = ExactVerification(target, max_rows, target.config._attn_implementation or "sdpa")
    target.set_attn_implementation(ATTENTION_NAME)
    target._angelspec_exact = state
    try:
        _reroute_linears(target, state)
    except ExactVerificationError:
        state.undo()
        raise
    logger.info("exact verification: attention %s, %d linear layers rerouted (%s)", ATTENTION_NAME, len(state.plans),
                sorted({(p.pad_single, p.largest_block) for p in state.plans.values()}))
    if check:
        try:
            failures = check_verification_exact(target, max_rows)
        except ExactVerificationError:
            # The exact attention refuses what it does not implement (attention sinks, soft-capping)
            # on the check's first forward: the target must not keep it.
            state.undo()
            raise
        if failures:
            state.undo()
            raise ExactVerificationError(
                "after make_verification_exact the target still scores some positions differently in a verify "
                f"forward than in plain decoding ((context, width): rows {failures}); its kernels are not supported. "
                "Run the target in float32 instead, or pass a smaller max_rows.")
    return state


def _reroute_linears(target, state: ExactVerification) -> None:
    """Probe each distinct ``nn.Linear`` shape once and reroute the layers whose rows need it."""
    by_shape: dict[tuple, RowPlan] = {}
    for name, module in target.named_modules():
        if type(module) is not torch.nn.Linear:
            continue
        shape = (tuple(module.weight.shape), module.weight.dtype, module.weight.device, module.bias is not None)
        if shape not in by_shape:
            by_shape[shape] = plan_linear(module.weight, module.bias, state.max_rows)
        plan = by_shape[shape]
        if plan.needed(state.max_rows):
            module._angelspec_row_plan = (plan, state.max_rows)
            module.forward = types.MethodType(_row_stable_linear, module)
            state.plans[name] = plan


@torch.no_grad()
def check_verification_exact(target, max_rows: int, contexts: tuple[int, ...] = (37, 250, 505), seed: int = 0) -> dict:
    """Bit-for-bit comparison of plain decoding with verify forwards of every width 2..``max_rows``
    after random contexts (250 and 505 plus a width cross key blocks); returns ``{(context, width): rows}``
    of every mismatch (empty when exact)."""
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator(device="cpu").manual_seed(seed)
    failures = {}
    for context in contexts:
        prompt = torch.randint(0, vocab, (1, context), generator=generator).to(target.device)
        tokens = torch.randint(0, vocab, (1, max_rows), generator=generator).to(target.device)
        cache = DynamicCache(config=target.config)
        target(prompt, past_key_values=cache, use_cache=True)
        # Sliding-window layers (Gemma 3 and 4, Cohere 2) drop keys beyond the window and then refuse
        # to crop; recording them after the prefill is what `generate` does before it speculates.
        cache.activate_past_recording()
        plain = [target(tokens[:, i:i + 1], past_key_values=cache, use_cache=True).logits[0, -1] for i in range(max_rows)]
        cache.crop(-max_rows)
        for width in range(2, max_rows + 1):
            verified = target(tokens[:, :width], past_key_values=cache, use_cache=True).logits[0]
            cache.crop(-width)
            rows = [i for i in range(width) if not torch.equal(verified[i], plain[i])]
            if rows:
                failures[(context, width)] = rows
    return failures
