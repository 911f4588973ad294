"""What every AngelSpec drafter shares: small layers, binding to a target, the candidate-generator
protocol of `transformers`' assisted decoding, and the dispatch that lets
``target.generate(assistant_model=drafter)`` use it.

Single-file style (torch, transformers and sibling modules only) so that ``save_pretrained`` ships
it as Hub remote code: a process that never imported ``angelspec_hf`` still gets the integration
when it loads a drafter with ``trust_remote_code=True``.
"""

import functools
import json
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from .configuration_angelspec_common import FINGERPRINT_DIMS, FINGERPRINT_ROWS, AngelSpecDrafterConfig
from .errors import (
    AngelSpecError,
    BatchSizeNotSupportedError,
    DrafterConfigError,
    DrafterCheckpointError,
    DrafterTargetMismatchError,
    UnsupportedCacheError,
    UnsupportedGenerationModeError,
)

logger = logging.get_logger(__name__)

# Cosine similarity that still counts as "the same embeddings": bf16 or 4-bit copies of one
# target stay above 0.99, unrelated matrices land near 0.
FINGERPRINT_MIN_COSINE = 0.95


# --------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# --------------------------------------------------------------------------- drafting kernels on CPUs
#
# Drafting multiplies small weights by few rows (one per drafted sequence, or a block of 8), so its
# cost on a CPU is the kernel's per-call cost. oneDNN's linear on a weight reordered ("packed") once
# beats the stock kernels there. Measured on an AMD EPYC with AVX-512 BF16, one thread, us per call,
# stock / packed: bfloat16 4096x576 at 1 / 8 / 200 rows 186/88, 313/199, 4609/4311; 1536x576
# 83/44, 130/86, 1654/1629; float32 4096x576 265/158, 826/404, 10646/8697, but float32 192x576 at one
# row 9/22 (the BLAS's matrix-vector path wins there). Through `generate` on the reference target
# (bfloat16 drafters, 4 code or 3 chat prompts, two passes interleaved, same output): a DFly-Block8
# draft 11.1 -> 8.3 ms (generate 4.5% faster), DFlash-Block8 5.8 -> 4.5 ms (4.2%), MTP-TTT3 7.9 ->
# 5.2 ms (3.7%).

_ROW_KERNELS: dict[tuple, str] = {}  # (shape, dtype) -> fastest one-row kernel on this CPU
# Owner (a layer or a `RowLinear`) -> its packed weight (or None where packing disagrees), as a
# `derived_value`. Kept beside the owners: a packed weight is an opaque oneDNN tensor that
# `copy.deepcopy` and pickling cannot copy, so a copied drafter packs its own on first use.
_PACKED_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (shape, dtype, has bias) -> whether the packed product agrees with F.linear on this machine.
_PACKING_AGREES: dict[tuple, bool] = {}
# Relative to the largest output: two kernels summing in another order (bfloat16 rounds its output).
PACKING_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@functools.lru_cache(maxsize=None)
def packing_dtypes() -> frozenset:
    """Dtypes oneDNN's packed linear serves here: float32 wherever PyTorch has oneDNN, bfloat16 only
    on CPUs with bfloat16 units (elsewhere it is emulated, and drafters run in float32 anyway)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return frozenset()
    return frozenset({torch.float32, torch.bfloat16} if cpu_has_bfloat16_units() else {torch.float32})


def packing_serves(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a packed weight may compute ``F.linear(x, weight)``: inference (no gradient wanted)
    on a CPU, both in one dtype oneDNN packs here."""
    return (weight.device.type == "cpu" and x.dtype == weight.dtype and weight.dtype in packing_dtypes()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through a weight packed by ``torch.ops.mkldnn._reorder_linear_weight``."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def packing_error(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> float:
    """Largest difference between the packed product and ``F.linear`` on random rows, relative to
    the largest output."""
    x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.no_grad():
        expected = F.linear(x, weight, bias).float()
        got = packed_product(x, packed, bias).float()
    return float((got - expected).abs().max()) / (float(expected.abs().max()) or 1.0)


def tensor_stamp(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """What names the contents of ``tensors`` for a cache of values computed from them: per tensor a
    weak reference (its identity while alive: a tensor allocated where a freed one was never
    matches), its data pointer (``.data`` swapped under the same object keeps the version) and its
    version (bumped by every in-place update through PyTorch)."""
    return tuple((weakref.ref(tensor), tensor.data_ptr(), tensor._version) for tensor in tensors)


def derived_value(cache: weakref.WeakKeyDictionary, owner: object, sources: tuple[torch.Tensor, ...],
                  key: object, build, *args):
    """``owner``'s value ``build(*args)`` computed from ``sources`` and ``key`` (whatever else it
    depends on), kept in ``cache`` and computed again when a source changed since (updated in place,
    replaced or ``.data``-swapped, see `tensor_stamp`) or ``key`` differs. The one rule for every
    value kept beside a model and computed from its tensors: a stale one would break losslessness,
    not just speed. Writes that bypass PyTorch's version counter (through a NumPy view of the
    memory) are not seen."""
    entry = cache.get(owner)
    # Inline and without closures: verify forwards ask once per linear layer (about 1 us a call).
    if entry is not None and entry[1] == key and len(entry[0]) == len(sources):
        for (ref, pointer, version), tensor in zip(entry[0], sources):
            if ref() is not tensor or pointer != tensor.data_ptr() or version != tensor._version:
                break
        else:
            return entry[2]
    value = build(*args)
    cache[owner] = tensor_stamp(sources), key, value
    return value


def _pack_weight(weight: torch.Tensor, bias: torch.Tensor | None, check: bool) -> torch.Tensor | None:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    return packed if not check or packing_agrees(weight, packed, bias) else None


def packed_weight(owner: object, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  check: bool = True) -> torch.Tensor | None:
    """``owner``'s packed copy of ``weight``, packed again when the weight changed since (see
    `derived_value`). With ``check``, None where the packed product disagrees with ``F.linear``
    on this machine (checked once per shape and dtype; the caller then keeps ``F.linear``, and the
    refusal is kept like a packed copy)."""
    return derived_value(_PACKED_WEIGHTS, owner, (weight,), check, _pack_weight, weight, bias, check)


def packing_agrees(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the packed product agrees with ``F.linear`` on this machine, checked once per shape
    and dtype (a warning names a shape that does not)."""
    key = (tuple(weight.shape), weight.dtype, bias is not None)
    if key not in _PACKING_AGREES:
        error = packing_error(weight.detach(), packed, None if bias is None else bias.detach())
        _PACKING_AGREES[key] = error <= PACKING_TOLERANCE[weight.dtype]
        if not _PACKING_AGREES[key]:
            logger.warning("oneDNN's packed linear differs from F.linear by %.2e (relative) on a %s %s weight on "
                           "this machine; drafting keeps the stock kernels for it.", error, tuple(weight.shape),
                           weight.dtype)
    return _PACKING_AGREES[key]


def forget_packed_weight(owner: object) -> None:
    """Free ``owner``'s packed copy (the next packed product packs again)."""
    _PACKED_WEIGHTS.pop(owner, None)


def packing_pays(weight: torch.Tensor, rows: int) -> bool:
    """Packed beats the stock kernels for two or more rows in either dtype, and for one row in
    bfloat16; one float32 row keeps the BLAS's matrix-vector path (or `RowLinear`'s timed pick)."""
    return rows >= 2 or (rows == 1 and weight.dtype == torch.bfloat16)


def drafting_linear(owner: object, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``owner``'s packed copy of the weight where
    `packing_serves` and `packing_pays` (see the measurements above)."""
    if x.shape[-1] and packing_serves(weight, x) and packing_pays(weight, x.numel() // x.shape[-1]):
        packed = packed_weight(owner, weight, bias)
        if packed is not None:
            return packed_product(x, packed, bias)
    return F.linear(x, weight, bias)


class DraftLinear(nn.Linear):
    """``nn.Linear`` of drafter layers whose inference products on a CPU use `drafting_linear`;
    training and other devices run ``F.linear``. Same parameters and state dict as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drafting_linear(self, x, self.weight, self.bias)


def _time_row_kernel(kernel: str, weight: torch.Tensor, x: torch.Tensor, calls: int = 16) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        _apply_row_kernel(kernel, weight, x)
    return time.perf_counter() - start


def _apply_row_kernel(kernel: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if kernel == "linear":
        return F.linear(x, weight)
    if kernel == "packed":
        return packed_product(x.to(weight.dtype), weight).to(x.dtype)
    return torch.mv(weight, x[0].to(weight.dtype))[None].to(x.dtype)


def fastest_row_kernel(weight: torch.Tensor) -> str:
    """Which of ``linear`` (the GEMM kernels), ``mv`` (matrix-vector), ``mv-float32`` (a float32
    copy, for half-precision weights) or ``packed`` (oneDNN on a packed copy, where `packing_dtypes`
    allows and it agrees with ``F.linear``) computes a one-row product with ``weight`` fastest on
    this CPU, timed once per shape and dtype in a process (0.17-0.21 s for DFly-Block8's three shapes
    before ``packed`` joined). Why measured: the ranking
    flips between CPUs (one thread, bfloat16 4096x576: a Xeon with AMX 324 us as a product and 241
    us as a matrix-vector product; an AMD EPYC 283 us and 504 us, and 223 us in float32)."""
    if weight.device.type != "cpu":
        return "linear"
    key = (tuple(weight.shape), weight.dtype)
    if key not in _ROW_KERNELS:
        candidates = {"linear": weight, "mv": weight}
        if weight.dtype in (torch.bfloat16, torch.float16):
            candidates["mv-float32"] = weight.float()
        if weight.dtype in packing_dtypes():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            if packing_agrees(weight, packed):
                candidates["packed"] = packed
        # A private generator: timing must not move the caller's seeded random stream.
        x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        with torch.no_grad():
            for kernel, candidate in candidates.items():
                _time_row_kernel(kernel, candidate, x, calls=2)  # warm-up
            # Best of five rounds taken in turn, so that one slow spell does not decide.
            best = dict.fromkeys(candidates, float("inf"))
            for _ in range(5):
                for kernel, candidate in candidates.items():
                    best[kernel] = min(best[kernel], _time_row_kernel(kernel, candidate, x))
        _ROW_KERNELS[key] = min(best, key=best.get)
    return _ROW_KERNELS[key]


class RowLinear:
    """``F.linear(x, weight)`` (no bias) for a sequential draft step, whose products have one row
    per drafted sequence: a single row goes through the kernel `fastest_row_kernel` picks (chosen
    at the first such call, so that batched and training use never time anything), more rows
    through a packed weight where `packing_serves` (else, and with a gradient, ``F.linear``). A
    drafter pays these products on every drafted position, so their per-call cost is most of a
    sequential round. The result has ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.kernel: str | None = None
        self._row_weight, self._row_kernel = weight, "linear"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] != 1 or x.requires_grad:
            return drafting_linear(self, x, self.weight)
        if self.kernel is None:
            self.kernel = fastest_row_kernel(self.weight)
            if self.kernel == "mv-float32":
                self._row_weight = self.weight.float()
            elif self.kernel == "packed":
                self._row_weight = packed_weight(self, self.weight, check=False)
            self._row_kernel = self.kernel.removesuffix("-float32")
        return _apply_row_kernel(self._row_kernel, self._row_weight, x)


class SwiGLU(nn.Module):
    def __init__(self, in_size: int, intermediate_size: int, out_size: int):
        super().__init__()
        self.gate_proj = DraftLinear(in_size, intermediate_size, bias=False)
        self.up_proj = DraftLinear(in_size, intermediate_size, bias=False)
        self.down_proj = DraftLinear(intermediate_size, out_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape (batch, 1, seq, head_dim) for integer positions of shape (batch, seq).

    Computed on the fly rather than cached in a buffer: it costs microseconds and leaves nothing
    for meta-device initialisation in ``from_pretrained`` to get wrong.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """(batch, seq, heads * dim) -> (batch, heads, seq, dim)."""
    return x.view(x.shape[0], x.shape[1], num_heads, head_dim).transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention; ``mask`` is boolean, True where a query may see a key."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def stack_right_padded(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Concatenate batch-1 tensors along the batch, zero-padding each at the end of ``dim``."""
    if len(tensors) == 1:
        return tensors[0]  # one row (a `propose` outside the engine): nothing to pad, nothing to copy
    width = max(t.shape[dim] for t in tensors)
    padded = []
    for t in tensors:
        missing = width - t.shape[dim]
        if missing:
            shape = list(t.shape)
            shape[dim] = missing
            t = torch.cat([t, t.new_zeros(shape)], dim=dim)
        padded.append(t)
    return torch.cat(padded)


# --------------------------------------------------------------------------- target binding


def sample_tokens(probabilities: torch.Tensor) -> torch.Tensor:
    """One token per row of (rows, V) probabilities (need not sum to 1): (rows, 1) indices.

    On a CPU by the inverse CDF, one uniform number a row, accumulated in float64 so that rounding
    cannot move mass between tokens, and a zero-probability token is never drawn (its CDF step is
    empty). Why: ``torch.multinomial`` draws an exponential number for every vocabulary entry, about
    1 ms for 49k entries on the reference CPU (one thread) against 56 us this way, and a sampled draft
    round draws once per drafted position. Other devices keep ``torch.multinomial``.
    """
    if probabilities.device.type != "cpu":
        return torch.multinomial(probabilities, num_samples=1)
    cdf = probabilities.double().cumsum(dim=-1)
    uniform = torch.rand(*cdf.shape[:-1], 1, dtype=cdf.dtype) * cdf[..., -1:]
    return torch.searchsorted(cdf, uniform, right=True).clamp_(max=cdf.shape[-1] - 1)


# Warpers that treat every column alike and read neither the ids nor the column order, so they warp
# a draft vocabulary's columns as they would the full vocabulary (whose other tokens are -inf).
COLUMN_WISE_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def warps_columns_alike(processors) -> bool:
    """Whether every logits processor of a generate call is one of `COLUMN_WISE_WARPERS`."""
    return all(type(processor) in COLUMN_WISE_WARPERS for processor in processors)


def expand_to_vocab(logits: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 logits over the full vocabulary from logits over ``token_ids``; other tokens get -inf.

    -inf (probability 0 under the draft) keeps speculative sampling exact: such tokens are never
    drafted, and the residual distribution restores the target's mass on them.
    """
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"), dtype=torch.float32)
    full[..., token_ids] = logits.float()
    return full


def sorted_draft_token_ids(token_ids, vocab_size: int, draft_vocab_size: int | None = None) -> torch.Tensor:
    """Validated, sorted, unique target ids of a reduced draft vocabulary."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().unique(sorted=True)
    if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise DrafterConfigError(f"draft_token_ids must be a non-empty set of ids in 0..{vocab_size - 1}.")
    if draft_vocab_size is not None and draft_vocab_size != ids.numel():
        raise DrafterConfigError(
            f"draft_vocab_size={draft_vocab_size} disagrees with the {ids.numel()} distinct draft_token_ids given."
        )
    return ids


class VocabSubsetHead:
    """The rows of a target ``lm_head`` (and of its bias) for a draft vocabulary, gathered once and
    kept by the drafter while they stay the same (`DFlyDrafter.draft_head`).

    ``dtype`` (default: the head's own) lets drafting score in the drafter's precision: a bfloat16
    copy halves the bytes each sequential draft step reads, and a draft's precision cannot change
    the output (the target verifies every token; sampling divides by the q that was sampled from).
    Training keeps the head's dtype, since the target side of its loss is scored here too.
    """

    def __init__(self, lm_head: nn.Module, token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype | None = None):
        self.weight = lm_head.weight.detach()[token_ids].to(dtype or lm_head.weight.dtype)
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else bias.detach()[token_ids].to(self.weight.dtype)
        self.token_ids, self.vocab_size = token_ids, vocab_size
        self.product = RowLinear(self.weight)

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the draft-vocabulary tokens only, in ``token_ids`` order."""
        hidden = hidden.to(self.weight.dtype)
        if self.bias is not None:
            return F.linear(hidden, self.weight, self.bias)
        return self.product(hidden)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return expand_to_vocab(self.subset_logits(hidden), self.token_ids, self.vocab_size)


def embedding_fingerprint(weight: torch.Tensor) -> list[float]:
    """A few values of fixed embedding rows: cheap to store, robust to dtype and quantisation."""
    rows = torch.linspace(0, weight.shape[0] - 1, FINGERPRINT_ROWS).round().long().to(weight.device)
    sample = weight.detach()[rows, :FINGERPRINT_DIMS].float().flatten().cpu()
    return [float(f"{value:.6g}") for value in sample.tolist()]


def fingerprint_similarity(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return 0.0
    return F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0).item()


def rope_theta_of(text_config) -> float:
    rope = getattr(text_config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return float(rope["rope_theta"])
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        # Models with per-attention-type RoPE (Gemma 3) keep several; the global one is the "full" one.
        for params in rope.values():
            if "rope_theta" in params:
                return float(params["rope_theta"])
    return float(getattr(text_config, "rope_theta", 10000.0))


def target_name(target: PreTrainedModel) -> str | None:
    return getattr(target.config, "_name_or_path", None) or getattr(target, "name_or_path", None) or None


def target_intermediate_size(text_config) -> int:
    """The target's MLP width, the drafter's default: older families name it otherwise (OPT ``ffn_dim``,
    GPT-2 ``n_inner``) or leave it at four times the hidden size (GPT-2, GPT-J, BLOOM, Falcon, MPT)."""
    for name in ("intermediate_size", "ffn_dim", "n_inner"):
        size = getattr(text_config, name, None)
        if isinstance(size, int) and size > 0:
            return size
    return 4 * text_config.hidden_size


def first_layer_config(text_config):
    """The config of the target's first decoder layer: the text config itself, except for
    transformers' heterogeneous configs, whose layers differ (Gemma 4's full-attention layers have
    their own ``head_dim``) and which raise on reading such an attribute for the whole model."""
    if getattr(text_config, "is_heterogeneous", False):
        return text_config.per_layer_config[0]
    return text_config


def target_config_fields(target: PreTrainedModel) -> dict[str, Any]:
    """Everything a drafter config must know about its target (the drafter's own layer is sized
    like the target's first one)."""
    text = target.config.get_text_config()
    layer = first_layer_config(text)
    num_heads = layer.num_attention_heads
    widths = {name: module.weight.shape[1] for name, module in
              (("input embeddings", target.get_input_embeddings()), ("output embeddings", target.get_output_embeddings()))
              if module is not None}
    projected = {name: width for name, width in widths.items() if width != text.hidden_size}
    if projected:
        # A drafter reads token embeddings beside the target's hidden states and scores its own
        # states with the target's head, so both must be as wide as the hidden states.
        raise DrafterConfigError(
            f"{text.model_type} target projects its embeddings ({projected}, hidden size {text.hidden_size}, "
            "as OPT-350m does): AngelSpec drafters need embeddings as wide as the hidden states. Use a target "
            "without embedding projections."
        )
    return {
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": target_intermediate_size(layer),
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(layer, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(layer, "head_dim", None) or text.hidden_size // num_heads,
        "rms_norm_eps": float(getattr(layer, "rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta_of(layer),
        "num_target_layers": text.num_hidden_layers,
        "target_name_or_path": target_name(target),
        "target_revision": getattr(target.config, "_commit_hash", None),
        "target_model_type": text.model_type,
        "target_embedding_fingerprint": embedding_fingerprint(target.get_input_embeddings().weight),
    }


def target_mismatches(config: AngelSpecDrafterConfig, target: PreTrainedModel) -> list[str]:
    """Human-readable differences between what the drafter was built for and ``target``."""
    text = target.config.get_text_config()
    problems = []
    for ours, theirs, label in (
        ("vocab_size", "vocab_size", "vocabulary size"),
        ("hidden_size", "hidden_size", "hidden size"),
        ("num_target_layers", "num_hidden_layers", "decoder layer count"),
    ):
        if getattr(config, ours) != getattr(text, theirs, None):
            problems.append(f"{label}: drafter expects {getattr(config, ours)}, target has {getattr(text, theirs, None)}")
    if config.target_embedding_fingerprint:
        similarity = fingerprint_similarity(
            config.target_embedding_fingerprint, embedding_fingerprint(target.get_input_embeddings().weight)
        )
        if similarity < FINGERPRINT_MIN_COSINE:
            problems.append(
                f"embedding fingerprint: similarity {similarity:.3f} < {FINGERPRINT_MIN_COSINE} "
                "(the target's token embeddings are not the ones the drafter was trained with)"
            )
    return problems


# --------------------------------------------------------------------------- statistics


def wait_for_device(device: torch.device) -> None:
    """Wait for the work queued on ``device``, so that a wall-clock timing ends when it has run.

    Why: CUDA kernels run asynchronously, so a timer stopped right after a forward times its launch;
    D-cut and the router weigh drafting time against verification time (and both against the cost
    profile), and each must be the work itself. A CPU runs in order: nothing to wait for."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class SpeculationStats:
    """Per-``generate`` statistics of one drafter: one entry per verification round after prefill."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    alternative_hits: int = 0  # rounds whose first token came from a first-token alternative

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens gained per target forward (accepted drafts + the target's own token)."""
        return (sum(self.accepted) + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(self.drafted)
        return sum(self.accepted) / drafted if drafted else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "drafted": list(self.drafted),
            "accepted": list(self.accepted),
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "alternative_hits": self.alternative_hits,
        }


# --------------------------------------------------------------------------- candidate generation


class BatchedDraft:
    """Per-row bookkeeping of a draft made for several rows at once: each row keeps the tokens and
    processed logits chosen for it until its budget is spent or its draft policy stops it.

    ``token_ids`` names the target ids of the logits' columns when a drafter scores a reduced draft
    vocabulary only. The tokens are picked in that smaller space, and the logits are spread over the
    target vocabulary once per round in `results`, not once per drafted position, unless a logits
    processor reads ids or the full vocabulary (a repetition penalty does): then each position is
    spread before it is processed. Temperature, top-k, top-p and min-p (sampling's usual warpers)
    warp the draft columns as they would the full vocabulary; either way the logits returned are
    exactly the distribution each token was drawn from, which is all speculative sampling needs.
    Rows whose generators do not want the draft distribution (greedy decoding) keep no logits at all.
    """

    def __init__(self, generators: list["AngelSpecCandidateGenerator"], input_ids: list[torch.LongTensor],
                 budgets: list[int], token_ids: torch.Tensor | None = None):
        self.generators, self.input_ids, self.budgets = generators, input_ids, budgets
        self.ids = list(input_ids)
        self.live = [budget > 0 for budget in budgets]
        self.tokens: list[list[torch.Tensor]] = [[] for _ in generators]
        self.logits: list[list[torch.Tensor]] = [[] for _ in generators]
        self.token_ids, self.vocab_size = token_ids, generators[0].drafter.config.vocab_size
        # A processor that reads ids or the full vocabulary gets each position spread before it runs.
        processors = generators[0].logits_processor
        self.spread_each_step = token_ids is not None and processors is not None and not warps_columns_alike(processors)
        self.in_draft_columns = token_ids is not None and not self.spread_each_step
        self.keep_logits = generators[0].wants_draft_logits

    def choose(self, position_logits: torch.Tensor, step: int, ask_policy: bool = True) -> torch.Tensor:
        """Pick every row's token at draft position ``step`` from (rows, columns) logits; target
        token ids (rows, 1)."""
        if self.spread_each_step:
            position_logits = expand_to_vocab(position_logits, self.token_ids, self.vocab_size)
        logits, chosen = AngelSpecCandidateGenerator.select_many(self.generators, self.ids, position_logits, self.live)
        if step == 0:
            self.record_alternatives(logits, chosen)
        if self.in_draft_columns:
            chosen = self.token_ids[chosen]
        for row, generator in enumerate(self.generators):
            if not self.live[row]:
                continue
            self.tokens[row].append(chosen[row : row + 1])
            if self.keep_logits:
                self.logits[row].append(logits[row : row + 1])
            self.ids[row] = torch.cat([self.ids[row], chosen[row : row + 1]], dim=-1)
            self.live[row] = step + 1 < self.budgets[row] and (
                not ask_policy or generator.keep_drafting(self.input_ids[row].shape[1]))
        return chosen

    def record_alternatives(self, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        """Each row's runner-up picks for the first draft position, as target ids (see
        `AlternativesVerification`), for the rows whose generator verifies any."""
        for row, generator in enumerate(self.generators):
            if generator.alternatives < 1 or not self.live[row]:
                continue
            ranked = logits[row].topk(generator.alternatives + 1).indices
            ranked = ranked[ranked != chosen[row, 0]][: generator.alternatives]
            generator.drafted_alternatives = self.token_ids[ranked] if self.in_draft_columns else ranked
            if generator.policy_weighs_alternatives:
                generator.alternative_confidences = logits[row].softmax(dim=-1)[ranked].tolist()

    @property
    def done(self) -> bool:
        return not any(self.live)

    def results(self) -> list[tuple[torch.LongTensor, torch.Tensor | None]]:
        """Per row: draft tokens (1, n) and their processed logits (1, n, V), None unless kept."""
        results = []
        for tokens, logits in zip(self.tokens, self.logits):
            if not self.keep_logits:
                results.append((torch.cat(tokens, dim=-1), None))
                continue
            logits = torch.stack(logits, dim=1)
            if self.in_draft_columns:
                logits = expand_to_vocab(logits, self.token_ids, self.vocab_size)
            results.append((torch.cat(tokens, dim=-1), logits))
        return results


def cpu_has_bfloat16_units() -> bool:
    """Whether oneDNN runs bfloat16 matmuls natively on this CPU (AVX-512 BF16 or AMX), not emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def warn_if_drafting_emulated(drafter: PreTrainedModel, target: PreTrainedModel) -> None:
    """Warn (once per drafter) when it drafts in a half precision this CPU only emulates, beside a
    float32 target: shipped drafters are saved in bfloat16, so ``AutoModel.from_pretrained(name)``
    loads them so. Measured on an AVX2-only EPYC, one thread, DFly-Block8 on a code prompt: a draft
    took 21 ms in bfloat16 against 16-17 ms in float32 (plain steps 52-70 ms), and 1.5x as long in
    passes run in turn. Verification is the target's, so the output does not change, only the time."""
    dtype = drafter.dtype
    if (getattr(drafter, "_angelspec_precision_warned", False) or dtype not in (torch.bfloat16, torch.float16)
            or drafter.device.type != "cpu" or target.dtype != torch.float32
            or (dtype == torch.bfloat16 and cpu_has_bfloat16_units())):
        return
    drafter._angelspec_precision_warned = True
    logger.warning(
        f"{type(drafter).__name__} drafts in {dtype} beside a float32 target on a CPU without {dtype} units, "
        "which emulates it: every drafting round is slower than in float32 (about 1.3-1.5x on an AVX2-only CPU). "
        "Fix: load the drafter with from_pretrained(..., dtype=target.dtype), or call drafter.to(target.dtype).")


class AngelSpecCandidateGenerator(CandidateGenerator):
    """Bridges a drafter and ``transformers``' assisted-decoding loop.

    The loop verifies, samples, crops the target cache, handles EOS, streamers and
    ``return_dict_in_generate``; this class only turns the verify forward's hidden states into the
    next draft. The target's embeddings and ``lm_head`` live here, never inside the drafter.
    Subclasses implement ``ingest`` (append context of newly committed positions) and ``draft``,
    or, as ours do, their batched forms ``ingest_many`` and ``draft_many`` (one generator per row,
    as the batched engine calls them), of which the single-row methods are the one-row case.
    """

    requires_model_outputs = True
    # Recognised by this flag, not by class: a process may hold two copies of this module (a drafter's
    # Hub remote code and the installed package), and the generate integration is the first one's.
    angelspec_candidate_generator = True

    def __init__(self, drafter: "AngelSpecPreTrainedModel", target: PreTrainedModel, generation_config, logits_processor):
        self.drafter = drafter
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.layer_ids = list(drafter.config.target_layer_ids)
        wanted = True if generation_config.output_hidden_states else [i + 1 for i in self.layer_ids]
        self.model_kwargs_overrides = {"output_hidden_states": wanted}
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        # Greedy verification compares tokens only; the draft distribution is read by speculative
        # sampling and by the assistant ensemble. Keeping and spreading a round's logits over the
        # target vocabulary cost 0.1-0.3 ms of a 6-14 ms drafting round on the reference target
        # (AMD EPYC, one thread), so greedy rounds skip it.
        self.wants_draft_logits = self.do_sample or getattr(generation_config, "assistant_ensemble_weight", None) is not None
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        self.committed = 0  # target positions whose features the drafter has ingested
        self.prefilled = False
        self.last_draft_length = 0
        self.last_draft_seconds = 0.0
        self.last_confidences: list[float] | None = None  # set in rounds a draft policy decided
        self.policy = getattr(drafter, "draft_policy", None)  # fixed for one generate call
        self.confidences: list[float] = []  # draft probability of each token drafted this round
        self.key_padding: torch.Tensor | None = None  # (1, committed) bool, None while all are real tokens
        self.verify_started: float | None = None  # when `generate` took this round's candidates
        # First-token alternatives (`AlternativesVerification`): 0 unless `generate` verifies them.
        self.alternatives = 0
        self.alternatives_width = 0  # the widest verify forward alternatives may make
        self.drafted_alternatives: torch.Tensor | None = None  # this round's, as drafted
        self.pending_alternatives: torch.Tensor | None = None  # this round's, as the verify forward takes them
        self.last_candidates: torch.Tensor | None = None  # the ids the loop verifies this round
        self.last_alternatives_verified = 0
        self.alternative_hit = False
        self.alternative_hit_index: int | None = None  # which alternative the target took, if one did
        # Their draft probabilities, for a policy that weighs them (`policy_weighs_alternatives`).
        self.alternative_confidences: list[float] = []
        self.stats = SpeculationStats()
        drafter.last_speculation_stats = self.stats
        warn_if_drafting_emulated(drafter, target)

    @property
    def max_draft_tokens(self) -> int:
        return self.drafter.max_draft_tokens

    def verify_alternatives(self, target: PreTrainedModel) -> "AlternativesVerification":
        """Hooks ``target`` so that its verify forwards also check this generator's first-token alternatives."""
        return AlternativesVerification(self, target)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        # The first round only prefills the target: a draft needs the features it produces.
        self.last_draft_length = 0
        self.last_confidences = None
        self.verify_started = None
        self.pending_alternatives = self.last_candidates = None
        if is_first_iteration:
            return input_ids, None
        self.observe_outputs(input_ids, model_outputs, model_kwargs)
        candidates, logits = self.propose(input_ids)
        self.last_candidates = candidates
        self.verify_started = time.perf_counter()
        return candidates, logits

    def observe_outputs(self, input_ids: torch.LongTensor, model_outputs: Any, model_kwargs: dict[str, Any] | None = None) -> None:
        """Append the context of the positions the last verify forward committed."""
        features = self._new_features(input_ids, model_outputs, model_kwargs)
        with torch.no_grad():
            self.ingest(input_ids, features)
        self.committed += features[0].shape[1]

    @classmethod
    def observe_many(cls, generators: list["AngelSpecCandidateGenerator"], input_ids: list[torch.LongTensor],
                     model_outputs: list[Any], model_kwargs: list[dict[str, Any] | None] | None = None) -> None:
        """`observe_outputs` for several sequences, one generator each (all of one drafter)."""
        model_kwargs = model_kwargs or [None] * len(generators)
        features = [generator._new_features(ids, outputs, kwargs)
                    for generator, ids, outputs, kwargs in zip(generators, input_ids, model_outputs, model_kwargs)]
        with torch.no_grad():
            cls.ingest_many(generators, input_ids, features)
        for generator, row_features in zip(generators, features):
            generator.committed += row_features[0].shape[1]

    @classmethod
    def ingest_many(cls, generators: list["AngelSpecCandidateGenerator"], input_ids: list[torch.LongTensor],
                    features: list[list[torch.Tensor]]) -> None:
        """``ingest`` of several generators; subclasses batch it, this one goes one row at a time."""
        for generator, ids, row_features in zip(generators, input_ids, features):
            generator.ingest(ids, row_features)

    def _new_features(self, input_ids: torch.LongTensor, model_outputs: Any,
                      model_kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
        """The drafter's input layers at the positions committed since the last call (and their key padding)."""
        num_new = input_ids.shape[1] - 1 - self.committed
        hidden_states = getattr(model_outputs, "hidden_states", None)
        if hidden_states is None or num_new < 1 or hidden_states[self.layer_ids[0] + 1].shape[1] < num_new:
            raise RuntimeError(
                "angelspec-hf lost track of the target's verified positions "
                f"(expected {num_new} new positions); please report this with the generate arguments used."
            )
        self._extend_key_padding(model_kwargs, num_new)
        return [hidden_states[i + 1][:, :num_new].to(self.drafter.dtype) for i in self.layer_ids]

    def propose(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft after ``input_ids`` (whose context is ingested); returns candidates and their logits."""
        budget = self._start_round(input_ids)
        if budget < 1:
            return input_ids, None
        start = time.perf_counter()
        with torch.no_grad():
            tokens, logits = self.draft(input_ids, budget)
        wait_for_device(tokens.device)
        return self._finish_round(input_ids, tokens, logits, time.perf_counter() - start)

    @classmethod
    def propose_many(
        cls, generators: list["AngelSpecCandidateGenerator"], input_ids: list[torch.LongTensor]
    ) -> list[tuple[torch.LongTensor, torch.Tensor | None]]:
        """`propose` for several sequences at once, one generator each (all of one drafter).

        A batched engine calls this so that a drafter runs one forward for all its rows instead of
        one per row (``draft_many``); each row's draft, confidences and statistics are what its own
        `propose` would give, up to floating-point differences of the batched kernels. The drafting
        time is shared evenly between the rows that drafted.
        """
        budgets = [generator._start_round(ids) for generator, ids in zip(generators, input_ids)]
        drafting = [i for i, budget in enumerate(budgets) if budget >= 1]
        results: list[tuple[torch.LongTensor, torch.Tensor | None]] = [(ids, None) for ids in input_ids]
        if not drafting:
            return results
        start = time.perf_counter()
        with torch.no_grad():
            drafts = cls.draft_many([generators[i] for i in drafting], [input_ids[i] for i in drafting],
                                    [budgets[i] for i in drafting])
        wait_for_device(input_ids[drafting[0]].device)
        seconds = (time.perf_counter() - start) / len(drafting)
        for i, (tokens, logits) in zip(drafting, drafts):
            results[i] = generators[i]._finish_round(input_ids[i], tokens, logits, seconds)
        return results

    @classmethod
    def draft_many(
        cls, generators: list["AngelSpecCandidateGenerator"], input_ids: list[torch.LongTensor], budgets: list[int]
    ) -> list[tuple[torch.LongTensor, torch.Tensor]]:
        """``draft`` of several generators; subclasses batch it, this one drafts one row at a time."""
        return [generator.draft(ids, budget) for generator, ids, budget in zip(generators, input_ids, budgets)]

    def _start_round(self, input_ids: torch.LongTensor) -> int:
        """Reset the round's record; the number of tokens to draft (0: skip the round)."""
        self.last_draft_length = 0
        self.last_confidences = None
        self.confidences = []
        self.drafted_alternatives = None
        self.alternative_hit = False
        self.alternative_hit_index = None
        self.alternative_confidences = []
        budget = min(self.max_draft_tokens, self.max_length - input_ids.shape[1] - 1)
        # An optional draft policy (D-cut, duck-typed so remote code needs nothing of ours) may
        # skip drafting or keep only a prefix; the choice uses draft-side information only, so
        # greedy output stays identical and sampling keeps the target distribution.
        if budget < 1 or (self.policy is not None and not self.policy.should_draft()):
            return 0
        return budget

    def _finish_round(self, input_ids: torch.LongTensor, tokens: torch.LongTensor, logits: torch.Tensor | None,
                      seconds: float) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Apply the policy's cut to a drafted round; the candidates and their logits (None where
        greedy verification does not read them)."""
        self.last_draft_seconds = seconds
        if self.policy is not None:
            keep = self.policy.choose(self.confidences, input_ids.shape[1], **self._alternatives_for_policy())
            self.last_confidences = self.confidences[:keep]
            tokens = tokens[:, :keep]
            logits = logits[:, :keep] if logits is not None else None
            if keep == 0:
                return input_ids, None
        self.last_draft_length = tokens.shape[1]
        if self.drafted_alternatives is not None:
            count = alternatives_verified(tokens.shape[1], len(self.drafted_alternatives), self.alternatives_width)
            self.pending_alternatives = self.drafted_alternatives[:count] if count else None
        candidates = torch.cat([input_ids, tokens.to(input_ids.device)], dim=-1)
        return candidates, logits.to(input_ids.device) if logits is not None else None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        if not self.prefilled:
            self.prefilled = True
            return
        self.stats.drafted.append(self.last_draft_length)
        self.stats.accepted.append(int(num_matches))
        self.stats.alternative_hits += int(self.alternative_hit)
        if self.verify_started is not None and hasattr(self.policy, "record_forward"):
            # What `generate` did since taking the candidates: the verify forward, plus its acceptance
            # and cache bookkeeping (a few percent at batch 1, which the policy's pace then carries).
            self.policy.record_forward(time.perf_counter() - self.verify_started,
                                       self.last_draft_length + 1 + self.last_alternatives_verified, self.committed + 1)
            self.verify_started = None
        if self.last_confidences is not None:
            # The policy calibrates the chain's confidences: an accepted alternative means its first
            # token was rejected.
            chain_matches = 0 if self.alternative_hit else int(num_matches)
            extra = {}
            if self.policy_weighs_alternatives and self.last_alternatives_verified:
                extra = {"alternatives": self.alternative_confidences[: self.last_alternatives_verified],
                         "alternative_hit": self.alternative_hit_index}
            self.policy.observe(self.last_confidences, chain_matches, self.last_draft_seconds, self.committed + 1, **extra)

    @property
    def policy_weighs_alternatives(self) -> bool:
        """Whether this round's draft policy prices first-token alternatives (a policy declares it
        with ``weighs_alternatives``; others are asked as before) and ``generate`` verifies any."""
        return self.alternatives > 0 and bool(getattr(self.policy, "weighs_alternatives", False))

    def _alternatives_for_policy(self) -> dict[str, Any]:
        """The keywords that tell a policy which alternatives a chain would be verified with: their
        draft probabilities and the widest forward they may make (none where it does not weigh them)."""
        if not self.policy_weighs_alternatives or not self.alternative_confidences:
            return {}
        return {"alternatives": self.alternative_confidences, "alternatives_width": self.alternatives_width}

    def _extend_key_padding(self, model_kwargs: dict[str, Any] | None, num_new: int) -> None:
        mask = (model_kwargs or {}).get("attention_mask")
        if mask is None:
            new = None
        else:
            new = mask[:, self.committed : self.committed + num_new].bool().to(self.embed_tokens.weight.device)
            if bool(new.all()):
                new = None
        if new is None and self.key_padding is None:
            return
        if new is None:
            new = torch.ones(1, num_new, dtype=torch.bool, device=self.key_padding.device)
        if self.key_padding is None:
            self.key_padding = torch.ones(1, self.committed, dtype=torch.bool, device=new.device)
        self.key_padding = torch.cat([self.key_padding, new], dim=-1)

    @staticmethod
    def select_many(generators: list["AngelSpecCandidateGenerator"], input_ids: list[torch.LongTensor],
                    logits: torch.Tensor, live: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Process one draft position's logits of several rows exactly as the target's are, then pick
        each row's token: ``logits`` (rows, V) -> processed float32 logits (rows, V), the draft
        distribution q that speculative sampling divides by, and tokens (rows, 1) (column indices:
        `BatchedDraft` maps them to target ids when the columns are a draft vocabulary). Only
        ``live`` rows record a confidence (for their draft policy)."""
        first = generators[0]
        logits = logits.float()
        if first.logits_processor is not None:
            # Processors read each row's own ids (a repetition penalty does), so they run per row.
            logits = torch.cat([generator.logits_processor(ids, row[None])
                                for generator, ids, row in zip(generators, input_ids, logits)])
        wants_confidence = [generator.policy is not None and alive for generator, alive in zip(generators, live)]
        probabilities = logits.softmax(dim=-1) if first.do_sample or any(wants_confidence) else None
        if first.do_sample:
            tokens = sample_tokens(probabilities)
        else:
            tokens = logits.argmax(dim=-1, keepdim=True)
        if any(wants_confidence):
            confidences = probabilities.gather(-1, tokens)[:, 0].tolist()
            for generator, wanted, confidence in zip(generators, wants_confidence, confidences):
                if wanted:
                    generator.confidences.append(confidence)
        return logits, tokens

    @staticmethod
    def stacked_context_mask(generators: list["AngelSpecCandidateGenerator"], lengths: list[int]) -> torch.Tensor:
        """Boolean (rows, 1, 1, max length) over context keys stacked right-padded: True where a row
        has a real key (its own key padding applied)."""
        device = generators[0].embed_tokens.weight.device
        width = max(lengths)
        mask = torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
        for row, generator in enumerate(generators):
            if generator.key_padding is not None:
                # Up to the row's context: an ingest has already extended it over the positions being added.
                padding = generator.key_padding[0, : lengths[row]].to(device)
                mask[row, : padding.shape[0]] &= padding
        return mask[:, None, None, :]

    def keep_drafting(self, context: int) -> bool:
        """Sequential drafters ask after each token whether the draft policy wants another one."""
        if self.policy is None or not hasattr(self.policy, "keep_drafting"):
            return True
        return self.policy.keep_drafting(self.confidences, context, **self._alternatives_for_policy())

    def ingest(self, input_ids: torch.LongTensor, features: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def draft(self, input_ids: torch.LongTensor, num_tokens: int) -> tuple[torch.LongTensor, torch.Tensor | None]:
        raise NotImplementedError


# --------------------------------------------------------------------------- first-token alternatives


def alternatives_verified(kept: int, available: int, max_width: int) -> int:
    """How many first-token alternatives a verify forward checks beside a chain of ``kept`` drafts:
    as many of the ``available`` ones as fit a forward of at most ``max_width`` tokens (the pending
    token, the chain, the alternatives), and none without a chain, whose first token they stand in for."""
    if kept < 1:
        return 0
    return max(0, min(available, max_width - (kept + 1)))

# Attention implementations known to apply a custom 4D mask as given (our exact kernel included).
_TREE_MASK_ATTENTION = ("sdpa", "eager", "angelspec_exact")


def tree_attention_mask(key_padding: torch.Tensor | None, past: int, width: int, alternatives: int,
                        additive_dtype: torch.dtype | None) -> torch.Tensor:
    """4D mask (1, 1, width + alternatives, past + width + alternatives) of a verify forward whose
    first ``width`` tokens are the usual chain (the last committed token and the draft) and whose
    last ``alternatives`` tokens each stand in for the draft's first token: they see the past and
    the committed token, not the chain nor each other. Boolean (True = visible) unless
    ``additive_dtype`` asks for eager attention's additive form."""
    rows = width + alternatives
    visible = torch.zeros(rows, past + rows, dtype=torch.bool)
    visible[:, :past] = True
    visible[:width, past : past + width] = torch.ones(width, width, dtype=torch.bool).tril()
    visible[width:, past] = True
    visible[width:, past + width :] = torch.eye(alternatives, dtype=torch.bool)
    visible = visible[None, None]
    if key_padding is not None:
        visible = visible.to(key_padding.device).clone()
        visible[..., :past] &= key_padding[:, None, None, :past].bool()
    return in_mask_form(visible, additive_dtype)


def in_mask_form(visible: torch.Tensor, additive_dtype: torch.dtype | None) -> torch.Tensor:
    """A boolean visibility mask as the attention takes it: as is, or additive in ``additive_dtype``."""
    if additive_dtype is None:
        return visible
    return torch.zeros(visible.shape, dtype=additive_dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(additive_dtype).min)


def tree_mask_dtype(target: PreTrainedModel) -> torch.dtype | None:
    """Eager attention adds its mask to the scores (in the target's dtype); the others take booleans."""
    return target.dtype if target.config._attn_implementation == "eager" else None


def tree_cache_ready(cache: Any) -> bool:
    """Whether every layer of ``cache`` keeps plain full-attention states, which an accepted
    alternative's entry can be moved within; sliding-window, KV-shared, linear-attention and
    quantized layers keep other bookkeeping."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def target_applies_tree_masks(target: PreTrainedModel) -> bool:
    """Whether ``target`` honours a custom 4D mask and explicit positions, checked once per target
    and attention implementation on a short random sequence: a token verified as an alternative
    (beside a chain token it must not see, at the chain token's position) must get the logits it
    gets when it is the chain. A family that rebuilds its own masks or positions fails the check
    and is verified without alternatives, so output never depends on it."""
    implementation = getattr(target.config, "_attn_implementation", None)
    if implementation not in _TREE_MASK_ATTENTION or getattr(target.config, "is_encoder_decoder", False):
        return False
    checked = getattr(target, "_angelspec_tree_mask_check", None)
    if checked is not None and checked[0] == implementation:
        return checked[1]
    device = target.get_input_embeddings().weight.device
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.config.get_text_config().vocab_size, (1, 7), generator=generator).to(device)
    # Tokens t0..t6: t5 verified as an alternative to t6 (both at position 5, after t0..t4) must get
    # the logits it gets as the chain's token.
    past = 4
    visible = torch.zeros(1, 1, 7, 7, dtype=torch.bool)
    visible[0, 0, :past, :past] = torch.ones(past, past, dtype=torch.bool).tril()
    visible[..., past:, :] = tree_attention_mask(None, past, 2, 1, None)
    mask = in_mask_form(visible, tree_mask_dtype(target))
    ids = torch.cat([tokens[:, :past + 1], tokens[:, 6:7], tokens[:, 5:6]], dim=-1)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 5]], device=device)
    try:
        with torch.no_grad():
            alone = target(tokens[:, :6], use_cache=False).logits[0, -1].float()
            tree = target(ids, attention_mask=mask.to(device), position_ids=positions,
                          use_cache=False).logits[0, -1].float()
        scale = alone.abs().max().clamp_min(1e-6)
        ok = bool(((tree - alone).abs().max() / scale) < 1e-2)
    except Exception as exc:  # a family whose forward refuses the mask: verify without alternatives
        logger.info("first-token alternatives off for %s: %s", type(target).__name__, exc)
        ok = False
    target._angelspec_tree_mask_check = (implementation, ok)
    return ok


class AlternativesVerification:
    """Verifies a round's first-token alternatives in the same target forward as its chain.

    A drafter's runner-up picks for the first draft position (see
    `AngelSpecPreTrainedModel.first_token_alternatives`) ride along in the verify forward under a
    tree mask. When the target's greedy token is one of them instead of the chain's first token, the
    round keeps that alternative and the target's token after it: two tokens where the chain gave
    one. ``transformers``' assisted-decoding loop stays in charge of acceptance, EOS, length,
    streamers and outputs: after the forward this class moves the alternative's logits, hidden
    states and cache entry into the chain's second slot and writes the alternative into the
    round's candidate ids (the tensor the loop compares against), so the loop accepts exactly what
    it would from a chain that had drafted the alternative first. The forward hooks live only for
    one ``generate`` call. Greedy decoding without logits processors only: the choice reads the
    target's raw argmax, as the loop does then.
    """

    def __init__(self, generator: "AngelSpecCandidateGenerator", target: PreTrainedModel):
        self.generator = generator
        self.additive = tree_mask_dtype(target)
        self.in_flight: tuple[Any, int, int, torch.Tensor] | None = None
        # Another thread's `generate` on the same target runs its own forwards.
        self.thread = threading.get_ident()
        self.handles = [
            target.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            target.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    # torch decides between the with- and without-kwargs call when it calls a hook, not when it
    # snapshots the hooks: another thread's forward may call this hook after `remove`, without
    # kwargs. Both hooks accept that call and leave such a forward alone.
    def _before_forward(self, module, args, kwargs=None):
        if kwargs is None or threading.get_ident() != self.thread:
            return None
        generator = self.generator
        alternatives, generator.pending_alternatives = generator.pending_alternatives, None
        self.in_flight = None
        generator.last_alternatives_verified = 0
        ids, cache, candidates = kwargs.get("input_ids"), kwargs.get("past_key_values"), generator.last_candidates
        if alternatives is None or args or ids is None or candidates is None:
            return None
        width = ids.shape[1]
        # Only the forward that verifies this round's chain.
        if (width != generator.last_draft_length + 1 or not tree_cache_ready(cache)
                or not torch.equal(ids[0], candidates[0, -width:].to(ids.device))):
            return None
        past = cache.get_seq_length()
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(past, past + width, device=ids.device)[None]
        if positions.dim() != 2:  # multimodal rotary positions (one row per axis): keep the chain
            return None
        count = alternatives.numel()
        key_padding = kwargs.get("attention_mask")
        if key_padding is not None and key_padding.dim() != 2:
            return None
        kwargs["input_ids"] = torch.cat([ids, alternatives.to(ids.device)[None]], dim=-1)
        kwargs["position_ids"] = torch.cat([positions, positions[:, 1:2].expand(1, count)], dim=-1)
        kwargs["attention_mask"] = tree_attention_mask(key_padding, past, width, count, self.additive).to(ids.device)
        if "logits_to_keep" in kwargs:
            # Logits of every token of the forward: the chain's and the alternatives'.
            kwargs["logits_to_keep"] = width + count
        self.in_flight = (cache, past, width, alternatives)
        generator.last_alternatives_verified = count
        return args, kwargs

    def _after_forward(self, module, args, *kwargs_and_output):
        if len(kwargs_and_output) != 2 or self.in_flight is None or threading.get_ident() != self.thread:
            return None
        output = kwargs_and_output[1]
        cache, past, width, alternatives = self.in_flight
        self.in_flight = None
        count = alternatives.numel()
        logits = output.logits  # one row per token of the forward (see `_before_forward`)
        picked = logits[0, 0].argmax()
        candidates = self.generator.last_candidates
        first_drafted = candidates.shape[1] - (width - 1)
        hit = None
        if picked != candidates[0, first_drafted]:
            matches = (alternatives.to(picked.device) == picked).nonzero()
            hit = int(matches[0, 0]) if matches.numel() else None
        self.generator.alternative_hit = hit is not None
        self.generator.alternative_hit_index = hit
        rows = torch.arange(width, device=logits.device)
        if hit is not None:
            rows[1] = width + hit
        output.logits = logits[:, rows]
        total = width + count
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(
                state[:, rows.to(state.device)] if torch.is_tensor(state) and state.shape[1] == total else state
                for state in output.hidden_states)
        if hit is not None:
            for layer in cache.layers:
                layer.keys[:, :, past + 1] = layer.keys[:, :, past + width + hit]
                layer.values[:, :, past + 1] = layer.values[:, :, past + width + hit]
            candidates[0, first_drafted] = int(alternatives[hit])
            if width > 2:
                # The loop must stop after the alternative and the target's token that follows it.
                following = int(output.logits[0, 1].argmax())
                candidates[0, first_drafted + 1] = (following + 1) % output.logits.shape[-1]
        cache.crop(-count)
        return output


# --------------------------------------------------------------------------- base model


def token_id_problems(name: str, ids: torch.Tensor, vocab_size: int) -> list[str]:
    """Why ``ids`` (from the tensor ``name``) are not distinct token ids of a ``vocab_size`` vocabulary."""
    problems = []
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        problems.append(f"{name} names token ids {outside[:4].tolist()} outside the target's 0..{vocab_size - 1}")
    if int(ids.unique().numel()) != ids.numel():
        values, counts = ids.unique(return_counts=True)
        problems.append(f"{name} names token ids {values[counts > 1][:4].tolist()} more than once")
    return problems


def _is_checkpoint_failure(exc: BaseException) -> bool:
    """Whether ``from_pretrained`` failed reading the checkpoint's files: missing or unreadable files
    (OSError; transformers turns an invalid config.json into one), a damaged safetensors file, an
    index that is not JSON. A bad argument (``dtype="float33"``, ``device_map="nowhere"``) raises a
    ValueError or RuntimeError of transformers or torch and must reach the caller as it is: wrapped,
    it was blamed on the checkpoint with a "re-download" fix."""
    if isinstance(exc, (OSError, json.JSONDecodeError, UnicodeDecodeError)):
        return True
    kind = type(exc)
    return kind.__module__.startswith("safetensors") or "safetensor" in kind.__name__.lower()


class AngelSpecPreTrainedModel(PreTrainedModel):
    """Base of the drafters: target binding, strict loading, and the ``generate`` hook."""

    config_class = AngelSpecDrafterConfig
    base_model_prefix = "drafter"
    main_input_name = "input_ids"
    _supports_sdpa = True
    candidate_generator_class: type[AngelSpecCandidateGenerator] = AngelSpecCandidateGenerator
    # Runner-up tokens for the first draft position that greedy `generate` verifies beside the chain
    # (`AlternativesVerification`), in rounds whose verify forward stays at most
    # `alternatives_verify_width` tokens wide: on the reference target on one CPU thread (AVX-512
    # EPYC, float32 packed linears) a forward of 4 or 6 new tokens took 60.4 / 60.6 ms and one of 7
    # took 69.1 ms, so MTP's chain of 3 gets two alternatives for free and an 8-wide block draft
    # none (forced beside it, one was level and two cost DFly-Block8 4% on code). A GPU verifies many more tokens for the price of
    # one: raise the width there. Set either per instance; 0 alternatives turns them off.
    first_token_alternatives: int = 2
    alternatives_verify_width: int = 6

    @property
    def max_draft_tokens(self) -> int:
        raise NotImplementedError

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            if getattr(module, "zero_init", False):
                init.zeros_(module.weight)
            else:
                init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained`` that refuses incomplete or corrupt checkpoints.

        Plain ``transformers`` would warn and randomly initialise missing tensors, which looks like
        a drafter that simply never gets accepted; here it is a `DrafterCheckpointError`.
        Only safetensors files are read.
        """
        want_info = kwargs.pop("output_loading_info", False)
        kwargs.setdefault("use_safetensors", True)
        # A tensor of the wrong shape is reported in the loading info (and refused below, by name)
        # rather than raised as a RuntimeError that names no tensor.
        kwargs["ignore_mismatched_sizes"] = True
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        except AngelSpecError:
            raise
        except Exception as exc:
            if not _is_checkpoint_failure(exc):
                raise
            raise DrafterCheckpointError(
                f"Could not load drafter weights from {str(pretrained_model_name_or_path)!r}: {exc}\n"
                "Fix: point to a directory (or Hub repo) holding config.json and model.safetensors as written "
                "by drafter.save_pretrained(); re-download or re-save it if the file is truncated or corrupt."
            ) from exc
        problems = {key: info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") if info.get(key)}
        if problems:
            details = "; ".join(f"{key}: {sorted(map(str, value))[:8]}" for key, value in problems.items())
            raise DrafterCheckpointError(
                f"The drafter checkpoint at {str(pretrained_model_name_or_path)!r} does not match {cls.__name__}: "
                f"{details}. Fix: the weights belong to another drafter configuration or were damaged; "
                "re-save the drafter with save_pretrained() or load it with the class that wrote it."
            )
        model.check_draft_vocabulary(str(pretrained_model_name_or_path))
        return (model, info) if want_info else model

    def check_draft_vocabulary(self, source: str) -> None:
        """A reduced draft vocabulary read from a checkpoint must name distinct target ids: ids out of
        range loaded and then failed inside generate with a bare IndexError."""
        if not self.config.uses_reduced_vocab:
            return
        problems = self.draft_vocabulary_problems()
        if problems:
            raise DrafterCheckpointError(
                f"The draft vocabulary stored at {source!r} is damaged: {'; '.join(problems)}. Fix: re-save the "
                "drafter with save_pretrained(), or rebuild its vocabulary (set_draft_vocab / angelspec-hf draft-vocab)."
            )

    # The buffer a reduced draft vocabulary is stored in, for errors that name it.
    draft_vocabulary_tensor: str = "draft_vocab"

    def draft_vocabulary_problems(self) -> list[str]:
        """What is wrong with `draft_token_ids` (empty when nothing): ids outside the target's
        vocabulary, or one id twice (two draft rows for one token)."""
        return token_id_problems(self.draft_vocabulary_tensor, self.draft_token_ids(), self.config.vocab_size)

    def push_to_hub(self, repo_id: str, private: bool | None = None, create_pr: bool = False, **kwargs):
        """Upload weights, config, remote code and a generated model card (a card you wrote is kept).

        With the ``angelspec_hf`` package installed the card lists the target, tags and measured
        numbers; without it (remote code only) this is ``PreTrainedModel.push_to_hub``.
        """
        try:
            from angelspec_hf.hub import push_drafter
        except ImportError:
            return super().push_to_hub(repo_id, private=private, create_pr=create_pr, **kwargs)
        # Every keyword reaches the upload (revision, commit_description, tags, ...); an unknown one is a TypeError.
        return push_drafter(self, repo_id, private=private, create_pr=create_pr, **kwargs)

    # -- binding -------------------------------------------------------------------------

    @classmethod
    def config_from_target(cls, target: PreTrainedModel, **overrides) -> AngelSpecDrafterConfig:
        fields = target_config_fields(target)
        fields.update(overrides)
        return cls.config_class(**fields)

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise `DrafterTargetMismatchError` unless ``target`` is the model this drafter was built for."""
        problems = target_mismatches(self.config, target)
        if problems:
            built_for = self.config.target_name_or_path or "another target"
            raise DrafterTargetMismatchError(
                f"This {type(self).__name__} was built for {built_for!r}, not for "
                f"{target_name(target) or type(target).__name__!r}: " + "; ".join(problems) + ". "
                f"Fix: load the drafter trained for this target, or build one with "
                f"{type(self).__name__}.from_target(target) and train it."
            )

    def check_generation_mode(self, generation_mode: str, generation_config) -> None:
        """Refuse a ``generate`` call that transformers would decode without the drafter: with beam
        search it logs a warning and runs plain beam search, so the drafter would only cost time."""
        if generation_mode == "assisted_generation":
            return
        beams = getattr(generation_config, "num_beams", 1)
        raise UnsupportedGenerationModeError(
            f"generate(assistant_model=drafter) with num_beams={beams} runs {generation_mode} without the drafter "
            "(transformers speculates only for greedy decoding and sampling), so nothing would be sped up. "
            "Fix: drop num_beams (and num_beam_groups) to decode speculatively, or drop assistant_model for beam search."
        )

    def validate_generate_call(self, input_ids: torch.Tensor, generation_config, model_kwargs: dict[str, Any]) -> None:
        """Checks made before ``transformers`` starts assisted decoding, with typed errors."""
        if input_ids.shape[0] != 1:
            raise BatchSizeNotSupportedError(
                f"target.generate(assistant_model=drafter) runs one sequence at a time, got a batch of "
                f"{input_ids.shape[0]}. Fix: call generate once per prompt, or serve batches with "
                "angelspec_hf.SpeculativeEngine."
            )
        if not model_kwargs.get("use_cache", True) or generation_config.use_cache is False:
            raise UnsupportedCacheError(
                "Speculative decoding needs the target's KV cache, and this call has it off (use_cache=False, "
                "passed or from the target's generation config, as MPT's is). Fix: pass use_cache=True."
            )
        cache = model_kwargs.get("past_key_values")
        implementation = generation_config.cache_implementation
        if (cache is not None and not isinstance(cache, DynamicCache)) or implementation not in (None, "dynamic"):
            name = type(cache).__name__ if cache is not None else implementation
            raise UnsupportedCacheError(
                f"Speculative decoding must roll the target's cache back after a rejected draft, which {name} "
                "cannot do. Fix: use the default DynamicCache (drop cache_implementation=... / past_key_values=...)."
            )

    def get_candidate_generator(self, target: PreTrainedModel, generation_config, logits_processor, **kwargs):
        """Called by the ``generate`` dispatch (after `check_target`); the generator for one call."""
        return self.candidate_generator_class(self, target, generation_config, logits_processor)

    def alternatives_for(self, generator: AngelSpecCandidateGenerator, target: PreTrainedModel, generation_config) -> int:
        """How many first-token alternatives a ``generate`` call verifies: `first_token_alternatives`
        where the call is greedy without logits processors or an assistant ensemble, returns no
        per-step attentions or hidden states (their shapes would show the extra tokens), and the
        target honours tree masks; 0 elsewhere (the plain chain)."""
        wanted = int(getattr(self, "first_token_alternatives", 0) or 0)
        if wanted < 0:
            raise DrafterConfigError(f"first_token_alternatives must be 0 or more, got {wanted}. "
                                     "Fix: set drafter.first_token_alternatives = 0 to verify the chain only.")
        outputs_shapes = generation_config.return_dict_in_generate and (
            generation_config.output_attentions or generation_config.output_hidden_states)
        if (wanted == 0 or generator.do_sample or generator.logits_processor is not None or outputs_shapes
                or getattr(generation_config, "assistant_ensemble_weight", None) is not None):
            return 0
        return wanted if target_applies_tree_masks(target) else 0


# --------------------------------------------------------------------------- generate dispatch

_DISPATCH_MARK = "_angelspec_hf_dispatch"
# The alternatives' forward hooks installed by the `generate` calls running on this thread (each
# call removes its own when it ends; calls on other threads, as a Space's, keep theirs).
_ALTERNATIVES_IN_USE = threading.local()


def _alternatives_in_use() -> list["AlternativesVerification"]:
    if not hasattr(_ALTERNATIVES_IN_USE, "stack"):
        _ALTERNATIVES_IN_USE.stack = []
    return _ALTERNATIVES_IN_USE.stack


def install_generate_integration() -> None:
    """Teach ``GenerationMixin`` to ask an assistant for its own candidate generator.

    Duck-typed on ``get_candidate_generator`` (with ``check_target`` and ``validate_generate_call``) so that drafters loaded as
    remote code (not instances of our classes) work too; every other assistant, prompt lookup and
    ``speculation_type="dflash"`` go to ``transformers``' own code unchanged. Idempotent.
    """
    dispatch = GenerationMixin._get_candidate_generator
    if getattr(dispatch, _DISPATCH_MARK, False):
        return
    validate_mode = GenerationMixin._validate_generation_mode
    assisted = GenerationMixin._assisted_decoding

    def ours(assistant, generation_config) -> bool:
        return hasattr(assistant, "get_candidate_generator") and getattr(generation_config, "speculation_type", None) != "dflash"

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        # Runs before transformers compares vocabularies, so a wrong target is named as such.
        assistant = generation_mode_kwargs.get("assistant_model")
        if ours(assistant, generation_config):
            assistant.check_target(self)
            assistant.check_generation_mode(generation_mode, generation_config)
        return validate_mode(self, generation_mode, generation_config, generation_mode_kwargs)

    def _assisted_decoding(self, input_ids, *args, **kwargs):
        assistant, generation_config = kwargs.get("assistant_model"), kwargs.get("generation_config")
        if ours(assistant, generation_config):
            assistant.validate_generate_call(input_ids, generation_config, kwargs)
        in_use = _alternatives_in_use()
        before = len(in_use)
        try:
            return assisted(self, input_ids, *args, **kwargs)
        finally:
            while len(in_use) > before:
                in_use.pop().remove()

    def _get_candidate_generator(self, *args, **kwargs):
        assistant, generation_config = kwargs.get("assistant_model"), kwargs.get("generation_config")
        if not ours(assistant, generation_config):
            return dispatch(self, *args, **kwargs)
        generator = assistant.get_candidate_generator(
            target=self,
            generation_config=generation_config,
            logits_processor=kwargs.get("logits_processor"),
            input_ids=kwargs.get("input_ids"),
            model_kwargs=kwargs.get("model_kwargs"),
        )
        alternatives_for = getattr(assistant, "alternatives_for", None)
        if getattr(generator, "angelspec_candidate_generator", False) and alternatives_for is not None:
            generator.alternatives = alternatives_for(generator, self, generation_config)
            generator.alternatives_width = int(getattr(assistant, "alternatives_verify_width", 0) or 0)
            if generator.alternatives:
                # The generator's own copy of the verification: it reads the generator's fields, which
                # another copy of this module (another version) may lay out differently.
                verify = getattr(generator, "verify_alternatives", None)
                _alternatives_in_use().append(verify(self) if verify else AlternativesVerification(generator, self))
        return generator

    for name, function in (
        ("_validate_generation_mode", _validate_generation_mode),
        ("_assisted_decoding", _assisted_decoding),
        ("_get_candidate_generator", _get_candidate_generator),
    ):
        setattr(function, _DISPATCH_MARK, True)
        setattr(GenerationMixin, name, function)


install_generate_integration()
