"""Inference-side policies that only the library needs (the candidate generators themselves live in
the modeling files so that they ship as remote code): the hardware cost model, D-cut, the
batched engine, exact verification in reduced precision and packed float32 linears for faster
verify forwards on CPUs."""

from .cost_model import CostModel, interleaved_verify_seconds, load_or_profile, profile_target
from .dcut import BatchDCutPolicy, DCutPolicy, FixedLengthPolicy
from .engine import EngineEvent, EngineRequestError, SpeculativeEngine
from .exact import check_verification_exact, make_verification_exact
from .packed import pack_linear_weights

__all__ = [
    "BatchDCutPolicy",
    "CostModel",
    "DCutPolicy",
    "EngineEvent",
    "EngineRequestError",
    "FixedLengthPolicy",
    "SpeculativeEngine",
    "check_verification_exact",
    "interleaved_verify_seconds",
    "load_or_profile",
    "make_verification_exact",
    "pack_linear_weights",
    "profile_target",
]
