"""The drafters shipped under modeling/ load, bind to the reference target's config, and carry
remote code identical to the library's (the copies exist for Hub users without angelspec_hf)."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p for p in (ROOT / "modeling").glob("*") if (p / "config.json").exists())
SOURCE = ROOT / "src" / "angelspec_hf"


@pytest.mark.parametrize("directory", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_drafter_is_complete_and_current(directory):
    config = json.loads((directory / "config.json").read_text())
    assert config["target_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (directory / "README.md").read_text().startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct")
    with safe_open(directory / "model.safetensors", "pt") as handle:
        dtypes = {k: str(handle.get_tensor(k).dtype) for k in handle.keys()}
    # Weights in bf16; integer buffers (token-id maps of a reduced draft vocabulary) stay integers.
    assert {d for k, d in dtypes.items() if k not in ("draft_vocab", "d2t", "t2d")} == {"torch.bfloat16"}
    for code in directory.glob("*.py"):
        assert code.read_text() == (SOURCE / code.name).read_text(), (
            f"{code} is stale: copy src/angelspec_hf/{code.name} over it (or re-save the drafter)"
        )
    from transformers import AutoModel

    import angelspec_hf  # noqa: F401

    model = AutoModel.from_pretrained(directory)
    assert model.config.target_embedding_fingerprint
