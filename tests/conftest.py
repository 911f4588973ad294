import os

# Before torch starts: busy-waiting OpenMP threads collapse under any other load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import angelspec_hf  # noqa: E402,F401  (registers the Auto classes and the generate integration)
from angelspec_hf import DFlyDrafter, MTPDrafter  # noqa: E402
from angelspec_hf.reference import tiny_target  # noqa: E402
from fitting import fit_dfly, fit_mtp, target_sequences  # noqa: E402

torch.set_num_threads(1)

PROMPT_LENGTH = 6
FAMILIES = ("llama", "qwen3")
# Every DFly switch combination, MTP and DFly with and without a reduced vocabulary, the DeepSeek-style
# MTP layer and an MTP drafter of two layers.
DRAFTER_KINDS = (
    "mtp",
    "mtp-reduced",
    "mtp-deepseek",
    "mtp-2layer",
    *(f"dfly-{conditioning}-{'corr' if correction else 'nocorr'}"
      for conditioning in ("global", "layerwise", "hybrid") for correction in (True, False)),
    "dfly-hybrid-corr-reduced",
)


def reduced_vocab(target, sequences=None) -> torch.Tensor:
    return torch.unique(sequences) if sequences is not None else torch.arange(target.config.vocab_size // 2)


def build_drafter(kind: str, target, sequences=None):
    """An untrained drafter of ``kind`` for ``target``; with ``sequences``, the reduced vocabulary covers them."""
    if kind == "mtp":
        return MTPDrafter.from_target(target, num_draft_tokens=4)
    if kind == "mtp-deepseek":
        return MTPDrafter.from_target(target, num_draft_tokens=4, layer_style="deepseek")
    if kind == "mtp-2layer":
        return MTPDrafter.from_target(target, num_draft_tokens=4, num_hidden_layers=2)
    if kind == "mtp-reduced":
        return MTPDrafter.from_target(target, num_draft_tokens=4, draft_token_ids=reduced_vocab(target, sequences))
    _, conditioning, correction, *reduced = kind.split("-")
    ids = reduced_vocab(target, sequences) if reduced else None
    return DFlyDrafter.from_target(target, block_size=6, conditioning=conditioning, hidden_correction=correction == "corr",
                                   draft_token_ids=ids)


class Targets:
    def __init__(self):
        self._targets, self._sequences, self._fitted = {}, {}, {}

    def target(self, family: str):
        if family not in self._targets:
            model = tiny_target(family, seed=FAMILIES.index(family))
            model.requires_grad_(False)
            self._targets[family] = model
        return self._targets[family]

    def sequences(self, family: str) -> torch.Tensor:
        if family not in self._sequences:
            self._sequences[family] = target_sequences(self.target(family), 12, PROMPT_LENGTH, 40, seed=1)
        return self._sequences[family]

    def fitted(self, family: str, kind: str):
        key = (family, kind)
        if key not in self._fitted:
            target, sequences = self.target(family), self.sequences(family)
            torch.manual_seed(0)
            drafter = build_drafter(kind, target, sequences)
            fit = fit_mtp if kind.startswith("mtp") else fit_dfly
            self._fitted[key] = fit(drafter, target, sequences, PROMPT_LENGTH, steps=250)
        return self._fitted[key]


@pytest.fixture(scope="session")
def targets() -> Targets:
    return Targets()
