"""The AngelSpec block-drafter format (Qwen3DFlyModel, DFlare): round trips, published configs,
the correction head written out from the published equation, and clear refusals."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from angelspec_hf import DFlyDrafter
from angelspec_hf.errors import DrafterCheckpointError, DrafterConfigError
from angelspec_hf.interop import export_angelspec, load_angelspec
from angelspec_hf.interop.angelspec import angelspec_drafter_config
from conftest import PROMPT_LENGTH
from fitting import same_generation as same_target_generation

FORMATS = Path(__file__).resolve().parents[2] / "shared" / "data" / "formats"


def same_generation(targets, a, b) -> bool:
    return same_target_generation(targets.target("llama"), a, b, targets.sequences("llama")[:1, :PROMPT_LENGTH])


@pytest.mark.parametrize("kind", ["dfly-hybrid-corr", "dfly-layerwise-nocorr"])
def test_export_then_load_is_the_same_drafter(targets, tmp_path, kind):
    drafter = targets.fitted("llama", kind)
    assert drafter.config.correction_embed_norm  # new drafters have AngelSpec's embedding norm
    export_angelspec(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    names = set(load_file(tmp_path / "model.safetensors"))
    if kind == "dfly-hybrid-corr":
        assert config["architectures"] == ["Qwen3DFlyModel"] and config["enable_hidden_correction"] is True
        assert {"context_proj.weight", "layer_fusion_weights", "hidden_correction.embed_norm.weight",
                "hidden_correction.gate_proj.weight", "layers.0.self_attn.q_proj.weight"} <= names
    else:
        assert config["model_arch"] == "dflare" and "context_proj.weight" not in names
    assert config["num_target_layers"] == len(drafter.config.target_layer_ids)
    assert config["target_num_hidden_layers"] == drafter.config.num_target_layers
    loaded = load_angelspec(tmp_path).eval()
    assert loaded.config.variant == drafter.config.variant
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert same_generation(targets, drafter, loaded)


def test_correction_head_is_the_published_equation(targets):
    """h' = h + down(silu(gate(x)) * up(x)), x = [rms(h) * w_h; rms(e) * w_e]."""
    drafter = targets.fitted("llama", "dfly-hybrid-corr")
    head = drafter.hidden_correction
    with torch.no_grad():
        head.embed_norm.weight.uniform_(0.5, 1.5)  # make the norm weights matter
        h, e = torch.randn(3, drafter.config.hidden_size), torch.randn(3, drafter.config.hidden_size)

        def rms(x, w):
            return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + drafter.config.rms_norm_eps)

        x = torch.cat([rms(h, head.norm.weight), rms(e, head.embed_norm.weight)], -1)
        expected = h + head.mlp.down_proj(torch.nn.functional.silu(head.mlp.gate_proj(x)) * head.mlp.up_proj(x))
        torch.testing.assert_close(head(h, e), expected)
        head.embed_norm.weight.fill_(1.0)


def test_published_configs_are_read():
    for name in ("angelspec_dfly_qwen3_8b_draft_config.json", "angelspec_dfly_hy3_draft_config.json",
                 "angelspec_dflare_draft_config.json", "angelspec_dflash_draft_config.json"):
        path = FORMATS / name
        if not path.exists():
            pytest.skip(f"shared format examples not present ({path})")
        raw = json.loads(path.read_text())
        with pytest.raises(DrafterConfigError, match="block size"):
            angelspec_drafter_config(raw)
        config = angelspec_drafter_config(raw, block_size=8)
        assert config.target_layer_ids == raw["target_layer_ids"]
        assert config.num_target_layers == raw["target_num_hidden_layers"]
        # AngelSpec's DFlash config counts the fused layers in num_target_layers (5 of the target's 36).
        assert config.variant == raw.get("model_arch", "dflash" if "dflash" in name else "dfly")
        assert config.hidden_correction == bool(raw.get("enable_hidden_correction"))


def test_refusals(targets, tmp_path):
    with pytest.raises(DrafterConfigError, match="--to dflash"):
        export_angelspec(targets.fitted("llama", "dfly-global-nocorr"), tmp_path)
    target = targets.target("llama")
    legacy = DFlyDrafter.from_target(target, block_size=4, correction_embed_norm=False)
    with pytest.raises(DrafterConfigError, match="normalises the previous token"):
        export_angelspec(legacy, tmp_path)
    export_angelspec(targets.fitted("llama", "dfly-hybrid-corr"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["markov_head.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(DrafterCheckpointError, match="not a plain AngelSpec"):
        load_angelspec(tmp_path)
