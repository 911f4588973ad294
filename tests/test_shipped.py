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


@pytest.mark.parametrize("directory", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_training_recipe_describes_the_shipped_model(directory):
    """The recorded recipe is what a reader reproduces the drafter from: its depth and draft sizes
    must be the weights' (the MTP drafter's once said two layers for a one-layer model)."""
    config = json.loads((directory / "config.json").read_text())
    recipe = json.loads((directory / "training_recipe.json").read_text())
    assert recipe["num_hidden_layers"] == config["num_hidden_layers"]
    if recipe.get("target_layer_ids") is not None:
        assert recipe["target_layer_ids"] == config["target_layer_ids"]
    if config["model_type"] == "angelspec_mtp":
        assert recipe["num_draft_tokens"] == config["num_draft_tokens"]
        assert recipe["draft_vocab_size"] == config["draft_vocab_size"]
    else:
        assert recipe["block_size"] == config["block_size"]
