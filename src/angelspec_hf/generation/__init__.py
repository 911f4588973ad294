"""Inference-side policies that only the library needs (the candidate generators themselves live in
the modeling files so that they ship as remote code): the hardware cost model, D-cut and the
batched engine."""

from .cost_model import CostModel, load_or_profile, profile_target
from .dcut import BatchDCutPolicy, DCutPolicy, FixedLengthPolicy
from .engine import EngineRequestError, SpeculativeEngine

__all__ = [
    "BatchDCutPolicy",
    "CostModel",
    "DCutPolicy",
    "EngineRequestError",
    "FixedLengthPolicy",
    "SpeculativeEngine",
    "load_or_profile",
    "profile_target",
]
