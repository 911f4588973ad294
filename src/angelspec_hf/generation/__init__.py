"""Inference-side policies that only the library needs (the candidate generators themselves live in
the modeling files so that they ship as remote code): the hardware cost model and D-cut."""

from .cost_model import CostModel, load_or_profile, profile_target
from .dcut import DCutPolicy, FixedLengthPolicy

__all__ = ["CostModel", "DCutPolicy", "FixedLengthPolicy", "load_or_profile", "profile_target"]
