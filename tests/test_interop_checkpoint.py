"""What every format reader shares (interop/checkpoint.py): settings of a foreign network that our
drafters do not compute are refused, corrupt or mismatched files are `DrafterCheckpointError`s that
name the file and the fix, and the stored dtype is kept."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from angelspec_hf import DFlyDrafter, MTPDrafter
from angelspec_hf.errors import DrafterCheckpointError, DrafterConfigError
from angelspec_hf.interop import (
    export_angelspec,
    export_angelspec_mtp,
    export_dflash,
    export_eagle3,
    load_angelspec,
    load_angelspec_mtp,
    load_dflash,
    load_eagle3,
)
from angelspec_hf.reference import tiny_target

FORMATS = ("dflash", "angelspec", "eagle3", "angelspec_mtp")
# Each reader is called as the CLI calls it without a target: our exports record what it would fill in.
LOADERS = {"dflash": load_dflash, "angelspec": load_angelspec, "eagle3": load_eagle3, "angelspec_mtp": load_angelspec_mtp}
# A tensor of each format, under the format's own name.
LAYER_TENSOR = {"dflash": "layers.0.self_attn.q_proj.weight", "angelspec": "layers.0.self_attn.q_proj.weight",
                "eagle3": "midlayer.self_attn.q_proj.weight", "angelspec_mtp": "midlayer.mlp.up_proj.weight"}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_hidden_layers=8, seed=0)  # EAGLE-3 reads three layers of it


def drafter_for(fmt: str, target):
    torch.manual_seed(0)
    if fmt == "dflash":
        return DFlyDrafter.from_target(target, block_size=4, conditioning="global", hidden_correction=False)
    if fmt == "angelspec":
        return DFlyDrafter.from_target(target, block_size=4, conditioning="hybrid", hidden_correction=True)
    if fmt == "eagle3":
        return MTPDrafter.from_target(target, draft_vocab_size=48)
    return MTPDrafter.from_target(target, layer_style="deepseek")


def export(fmt: str, drafter, target, path):
    if fmt == "dflash":
        return export_dflash(drafter, path)
    if fmt == "angelspec":
        return export_angelspec(drafter, path)
    if fmt == "eagle3":
        return export_eagle3(drafter, path)
    return export_angelspec_mtp(drafter, path, target=target)


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """One float32 export per format, copied by each test that edits it."""
    root = tmp_path_factory.mktemp("exports")
    return {fmt: export(fmt, drafter_for(fmt, target), target, root / fmt) for fmt in FORMATS}


def copy_of(exported, fmt: str, tmp_path):
    return shutil.copytree(exported[fmt], tmp_path / fmt)


def edit_config(path, **fields) -> None:
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))


UNSUPPORTED = {
    "rope_scaling.rope_type='yarn'": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 128}},
    "rope_parameters.rope_type='llama3'": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}},
    "use_sliding_window=True": {"use_sliding_window": True, "sliding_window": 16},
    "layer_types containing ['sliding_attention']": {"layer_types": ["sliding_attention"]},
    "hidden_act='gelu'": {"hidden_act": "gelu"},
    "attention_bias=True": {"attention_bias": True},
}


@pytest.mark.parametrize("setting", list(UNSUPPORTED))
@pytest.mark.parametrize("fmt", FORMATS)
def test_network_settings_we_do_not_compute_are_refused(exported, tmp_path, fmt, setting):
    """They loaded into a plain RoPE / full-attention / SiLU drafter, another network than the one trained."""
    path = copy_of(exported, fmt, tmp_path)
    edit_config(path, **UNSUPPORTED[setting])
    with pytest.raises(DrafterConfigError, match=rf"config\.json: .*{re.escape(setting)}.*do not implement.*Fix:"):
        LOADERS[fmt](path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_settings_that_leave_the_network_plain_are_read(exported, tmp_path, fmt):
    path = copy_of(exported, fmt, tmp_path)
    edit_config(path, rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                use_sliding_window=False, sliding_window=131072, layer_types=["full_attention"], hidden_act="silu",
                attention_bias=False)
    LOADERS[fmt](path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_checkpoints_are_checkpoint_errors_naming_the_file(exported, tmp_path, fmt):
    """A truncated file, a missing or broken config.json, a missing field and a tensor of the wrong shape
    leaked SafetensorError, FileNotFoundError, JSONDecodeError, KeyError and torch's RuntimeError."""
    path = copy_of(exported, fmt, tmp_path)
    load = LOADERS[fmt]
    weights, config = path / "model.safetensors", path / "config.json"
    intact_weights, intact_config = weights.read_bytes(), config.read_text()

    weights.write_bytes(intact_weights[: len(intact_weights) // 2])
    unreadable = rf"{re.escape(str(weights))} is not a readable safetensors file.*Fix: download"
    with pytest.raises(DrafterCheckpointError, match=unreadable):
        load(path)
    weights.write_bytes(intact_weights)

    config.unlink()
    with pytest.raises(DrafterCheckpointError, match=rf"{re.escape(str(config))} does not exist.*Fix:"):
        load(path)
    config.write_text(intact_config[:-10])
    with pytest.raises(DrafterCheckpointError, match=rf"{re.escape(str(config))} cannot be read as JSON.*Fix:"):
        load(path)
    raw = json.loads(intact_config)
    for field in ("intermediate_size", "num_attention_heads") + (("num_target_layers",) if fmt == "dflash" else ()):
        config.write_text(json.dumps({k: v for k, v in raw.items() if k != field}))
        with pytest.raises(DrafterCheckpointError, match=rf"{re.escape(str(config))}: The config has no '{field}'.*Fix:"):
            load(path)
    config.write_text(intact_config)

    tensors = load_file(weights)
    name = LAYER_TENSOR[fmt]
    tensors[name] = tensors[name][:-1]
    save_file(tensors, weights)
    with pytest.raises(DrafterCheckpointError, match=rf"tensor '{name}' has shape \(\d+, \d+\), but config\.json.*Fix:"):
        load(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_stored_dtype_is_kept(target, tmp_path, fmt):
    """Without dtype=, a bfloat16 file came back as float32 (twice the size once saved again)."""
    drafter = drafter_for(fmt, target).to(torch.bfloat16)
    export(fmt, drafter, target, tmp_path)
    loaded = LOADERS[fmt](tmp_path)
    assert loaded.dtype == torch.bfloat16
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert LOADERS[fmt](tmp_path, dtype=torch.float16).dtype == torch.float16
