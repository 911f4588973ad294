"""angelspec-hf: AngelSpec speculative-decoding drafters as Hugging Face models.

Importing the package registers the drafters with ``AutoConfig``/``AutoModel`` and installs the
``generate`` integration, so ``target.generate(**inputs, assistant_model=drafter)`` just works.
"""

import os
import sys

if "torch" not in sys.modules:
    # PyTorch's default OpenMP busy-waiting makes 2-thread CPU runs collapse as soon as anything
    # else runs; the variable is only read when torch starts, so set it before importing it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from transformers import AutoConfig, AutoModel  # noqa: E402

from . import errors  # noqa: E402
from .configuration_angelspec_dfly import DFlyDrafterConfig
from .configuration_angelspec_mtp import MTPDrafterConfig
from .modeling_angelspec_common import (
    SpeculationStats,
    embedding_fingerprint,
    install_generate_integration,
)
from .modeling_angelspec_dfly import DFlyDrafter
from .modeling_angelspec_mtp import MTPDrafter
from .generation import SpeculativeEngine  # noqa: E402

__version__ = "0.1.0"

AutoConfig.register(MTPDrafterConfig.model_type, MTPDrafterConfig, exist_ok=True)
AutoConfig.register(DFlyDrafterConfig.model_type, DFlyDrafterConfig, exist_ok=True)
AutoModel.register(MTPDrafterConfig, MTPDrafter, exist_ok=True)
AutoModel.register(DFlyDrafterConfig, DFlyDrafter, exist_ok=True)
install_generate_integration()

__all__ = [
    "DFlyDrafter",
    "DFlyDrafterConfig",
    "MTPDrafter",
    "MTPDrafterConfig",
    "SpeculationStats",
    "SpeculativeEngine",
    "embedding_fingerprint",
    "errors",
    "install_generate_integration",
]
