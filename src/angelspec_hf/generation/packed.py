"""Faster float32 verify forwards on CPUs: oneDNN's packed-weight GEMM for the target's linear
layers whenever they multiply two or more rows.

A verify forward multiplies every weight matrix by k+1 rows (the pending token and k drafts), plain
decoding by one. PyTorch's float32 ``F.linear`` on a CPU goes to the BLAS (MKL), whose one-row
matrix-vector path is fast, and whose few-row GEMMs, which re-pack the weight on every call, cost
up to twice as much. Measured on the reference target (an AMD EPYC with AVX2 only, one thread,
context 256, stock and packed runs interleaved): a forward of 1 new token took 74-85 ms, of 2 new
tokens 118-125 ms, of 9 new tokens 173-187 ms; packed, 96-108 ms for 2 and 130-137 ms for 9. Its
lm_head alone (49152 x 576) took 10.3 ms for one row, 22.5 for two and 29.4 for nine with
``F.linear``, 10.1 and 13.7 ms for two and nine rows with oneDNN's linear on a weight packed once
(timed beside a benchmark run: the ratios hold, not the times).
So a verify forward of 8 drafts cost 2.3 plain steps there with the stock kernels, 1.7 packed.

`pack_linear_weights` packs each ``nn.Linear`` weight of the target once for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``) and routes inputs of two or more rows through
``torch.ops.mkldnn._linear_pointwise``; a single row and anything needing gradients keep
``F.linear``, and a layer whose weight changed since packing is packed again on its next call.
Plain decoding (one row) therefore runs the stock kernels, and verify forwards and prefills the packed ones. The
results agree with ``F.linear`` to float32 rounding, like any two GEMM kernels (checked on every
packed shape when packing), which is the same agreement stock verify forwards have with plain
decoding: greedy output stays token-identical except on exact near-ties (see `make_verification_exact`
for bit-exact verification in reduced precision). The packed copies cost one more copy of the
linear weights in memory; ``undo()`` frees them.
"""

from __future__ import annotations

import logging
import math
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import AngelSpecError
from ..modeling_angelspec_common import forget_packed_weight, packed_product, packed_weight, packing_serves

logger = logging.getLogger(__name__)

MIN_ROWS = 2  # one row stays on the BLAS's matrix-vector path, which is as fast or faster
_TOLERANCE = 1e-4  # relative to the largest output: float32 GEMMs summing in another order


class PackedLinearError(AngelSpecError, RuntimeError):
    """The target's linear layers cannot be packed for oneDNN on this machine."""


@dataclass
class PackedLinears:
    """What `pack_linear_weights` changed on a target; ``undo()`` restores the stock layers."""

    target: torch.nn.Module
    names: list[str] = field(default_factory=list)

    def undo(self) -> None:
        modules = dict(self.target.named_modules())
        for name in self.names:
            modules[name].__dict__.pop("forward", None)
            forget_packed_weight(modules[name])
        self.target._angelspec_packed = None


def is_packed(target: torch.nn.Module) -> bool:
    return getattr(target, "_angelspec_packed", None) is not None


def packing_available() -> bool:
    """oneDNN packed float32 linears exist in this PyTorch build (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through the packed weight for two or more rows (bound per module as a
    method, so that ``copy.deepcopy`` of the model binds the copy's own weights)."""
    rows = math.prod(x.shape[:-1])
    # Float32 only (a target cast to bfloat16 after packing keeps the stock kernels); `packing_serves`
    # adds a float32 input on a CPU with no gradient wanted.
    if rows < MIN_ROWS or self.weight.dtype != torch.float32 or not packing_serves(self.weight, x):
        return F.linear(x, self.weight, self.bias)
    # Packed again if the weight changed since (updated in place or replaced); the shape was checked
    # when packing the target.
    return packed_product(x, packed_weight(self, self.weight, self.bias, check=False), self.bias)


def _check_shape(module: torch.nn.Linear) -> None:
    x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = F.linear(x, module.weight, module.bias)
        got = module(x)
    scale = float(expected.abs().max()) or 1.0
    error = float((got - expected).abs().max()) / scale
    if not error <= _TOLERANCE:
        raise PackedLinearError(
            f"oneDNN's packed linear differs from F.linear by {error:.2e} (relative) on a {tuple(module.weight.shape)} "
            "weight on this machine: use the stock kernels (do not call pack_linear_weights, or pass --stock-kernels).")


def pack_linear_weights(target: torch.nn.Module) -> PackedLinears:
    """Route ``target``'s float32 ``nn.Linear`` layers through oneDNN packed weights for inputs of two
    or more rows (verify forwards, prefills, batched decoding); one-row products keep the stock
    kernels. Every packed shape is checked against ``F.linear`` once. Idempotent; ``undo()`` on the
    result restores the stock layers. CPU and float32 only: raises `PackedLinearError` otherwise."""
    if is_packed(target):
        return target._angelspec_packed
    if not packing_available():
        raise PackedLinearError("This PyTorch build has no oneDNN (mkldnn) packed linear: use the stock kernels.")
    if target.device.type != "cpu" or target.dtype != torch.float32:
        raise PackedLinearError(f"pack_linear_weights is for float32 targets on a CPU, got {target.dtype} on "
                                f"{target.device.type}: use the stock kernels there.")
    if getattr(target, "_angelspec_exact", None) is not None:
        raise PackedLinearError("The target already has exact verification kernels (make_verification_exact), "
                                "which route its linear layers themselves: pack a float32 target without them.")
    state = PackedLinears(target)
    target._angelspec_packed = state
    checked: set[tuple] = set()
    try:
        for name, module in target.named_modules():
            if type(module) is not torch.nn.Linear or module.weight.dtype != torch.float32:
                continue
            packed_weight(module, module.weight, module.bias, check=False)
            module.forward = types.MethodType(_packed_linear, module)
            state.names.append(name)
            shape = (tuple(module.weight.shape), module.bias is not None)
            if shape not in checked:
                _check_shape(module)
                checked.add(shape)
    except Exception:
        state.undo()
        raise
    logger.info("packed %d linear layers for oneDNN (%d shapes)", len(state.names), len(checked))
    return state
