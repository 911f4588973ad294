"""The EAGLE-3 format: round trips, the published configs, and the layer written out by hand."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from angelspec_hf.errors import DrafterCheckpointError, DrafterConfigError
from angelspec_hf.interop import export_eagle3, load_eagle3
from angelspec_hf.interop.eagle3 import eagle3_drafter_config
from angelspec_hf import MTPDrafter
from conftest import PROMPT_LENGTH, reduced_vocab
from fitting import fit_mtp, same_generation

FORMATS = Path(__file__).resolve().parents[2] / "shared" / "data" / "formats"
EAGLE3_CONFIGS = ("angelspec_qwen3_8b_eagle3.json", "specforge_llama3-8B-eagle3.json",
                  "specforge_qwen2.5-0.5b-eagle3.json", "specforge_qwen3-8b-eagle3.json")


@pytest.fixture(scope="module")
def eagle_drafters(targets):
    """Fitted MTP drafters reading three target layers, as EAGLE-3 does (the tiny target has 4)."""
    target, sequences = targets.target("llama"), targets.sequences("llama")
    drafters = {}
    for kind, ids in (("mtp", None), ("mtp-reduced", reduced_vocab(target, sequences))):
        torch.manual_seed(0)
        drafter = MTPDrafter.from_target(target, num_draft_tokens=4, target_layer_ids=[0, 1, 2], draft_token_ids=ids)
        drafters[kind] = fit_mtp(drafter, target, sequences, PROMPT_LENGTH, steps=150)
    return drafters


@pytest.mark.parametrize("kind", ["mtp-reduced", "mtp"])
def test_export_then_load_is_the_same_drafter(targets, eagle_drafters, tmp_path, kind):
    target, drafter = targets.target("llama"), eagle_drafters[kind]
    export_eagle3(drafter, tmp_path, target=target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight",
            "d2t", "t2d", "norm.weight"} <= names
    loaded = load_eagle3(tmp_path, target=target).eval()
    assert loaded.config.target_layer_ids == drafter.config.target_layer_ids
    assert loaded.config.uses_reduced_vocab == drafter.config.uses_reduced_vocab
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert same_generation(target, drafter, loaded)


def test_full_vocabulary_export_needs_the_target(targets, eagle_drafters, tmp_path):
    with pytest.raises(DrafterConfigError, match="pass the target"):
        export_eagle3(eagle_drafters["mtp"], tmp_path)
    with pytest.raises(DrafterConfigError, match="exactly 3 target layers"):
        export_eagle3(targets.fitted("llama", "mtp-reduced"), tmp_path)
    with pytest.raises(DrafterConfigError, match="Only MTP drafters"):
        export_eagle3(targets.fitted("llama", "dfly-global-nocorr"), tmp_path)
    two_layers = MTPDrafter.from_target(targets.target("llama"), target_layer_ids=[0, 1, 2], num_hidden_layers=2)
    with pytest.raises(DrafterConfigError, match="one decoder layer; this MTP drafter has 2"):
        export_eagle3(two_layers, tmp_path)


def test_the_layer_matches_the_eagle3_equations(targets, eagle_drafters):
    """One EAGLE-3 step written out from the published architecture, on our loaded weights."""
    target, drafter = targets.target("llama"), eagle_drafters["mtp-reduced"]
    c = drafter.config
    torch.manual_seed(0)
    features = [torch.randn(1, 5, c.hidden_size) for _ in range(3)]
    tokens = torch.randint(0, c.vocab_size, (1, 5))

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    def rope(x, positions):
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        freqs = positions[:, None].float() * inv[None]
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    w = {k: v.float() for k, v in drafter.state_dict().items()}
    hidden = torch.cat(features, -1) @ w["fc.weight"].T
    x = torch.cat([rms(target.get_input_embeddings()(tokens), w["input_norm.weight"]),
                   rms(hidden, w["hidden_norm.weight"])], -1)
    positions = torch.arange(5)

    def heads(t, n):
        return t.view(1, 5, n, c.head_dim).transpose(1, 2)

    q = rope(heads(x @ w["self_attn.q_proj.weight"].T, c.num_attention_heads), positions)
    k = rope(heads(x @ w["self_attn.k_proj.weight"].T, c.num_key_value_heads), positions)
    v = heads(x @ w["self_attn.v_proj.weight"].T, c.num_key_value_heads)
    repeat = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = (q @ k.transpose(-1, -2)) / c.head_dim ** 0.5 + torch.full((5, 5), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 5, -1) @ w["self_attn.o_proj.weight"].T
    h = hidden + attn
    m = rms(h, w["post_attention_norm.weight"])
    h = h + (torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    draft_logits = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
    expected = torch.arange(drafter.config.draft_vocab_size) + w["d2t"].long()

    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        ours, _ = drafter(drafter.fuse(features), target.get_input_embeddings()(tokens), positions[None], None, mask)
        logits = drafter.vocab_logits(ours, target.lm_head)
    torch.testing.assert_close(ours, h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, draft_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(drafter.draft_token_ids(), expected)


def test_published_eagle3_configs_are_read():
    for name in EAGLE3_CONFIGS:
        path = FORMATS / name
        if not path.exists():
            pytest.skip(f"shared format examples not present ({path})")
        raw = json.loads(path.read_text())
        config = eagle3_drafter_config(raw, num_target_layers=32)
        assert config.draft_vocab_size == raw["draft_vocab_size"] and config.uses_reduced_vocab
        assert config.hidden_size == raw["hidden_size"] and config.num_key_value_heads == raw["num_key_value_heads"]
        assert config.target_layer_ids == [1, 15, 28]  # EAGLE-3's low, middle and high layers of 32
        with pytest.raises(DrafterConfigError, match="how deep its target is"):
            eagle3_drafter_config(raw)


def test_foreign_tensors_and_embeddings(targets, eagle_drafters, tmp_path):
    target, drafter = targets.target("llama"), eagle_drafters["mtp-reduced"]
    export_eagle3(drafter, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()  # some checkpoints carry it
    save_file(tensors, tmp_path / "model.safetensors")
    assert same_generation(target, drafter, load_eagle3(tmp_path, target=target).eval())
    tensors["midlayer.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(DrafterCheckpointError, match="not an EAGLE-3 checkpoint"):
        load_eagle3(tmp_path, target=target)


def test_a_file_recording_another_target_is_refused_when_loaded_with_one(tmp_path):
    """Our exports record the target's embedding fingerprint; loading with ``target=`` binds the drafter
    to that target, so a file trained for another one passed every later check (convert --target)."""
    from angelspec_hf.errors import DrafterTargetMismatchError
    from angelspec_hf.reference import tiny_target

    trained_for, other = (tiny_target("llama", num_hidden_layers=8, seed=seed) for seed in (0, 1))
    export_eagle3(MTPDrafter.from_target(trained_for, draft_vocab_size=48), tmp_path)
    with pytest.raises(DrafterTargetMismatchError, match="tiny-llama-seed0.*not for 'tiny-llama-seed1'"):
        load_eagle3(tmp_path, target=other)
    assert load_eagle3(tmp_path, target=trained_for).config.target_name_or_path == "tiny-llama-seed0"


def test_a_given_target_keeps_the_recorded_binding_and_must_match_its_depth(tmp_path):
    """What the file records about its target wins over the target given: the same weights under
    another name stay bound to the recorded name and fingerprint, and a target of another depth
    (same embeddings) is refused instead of re-binding the drafter to it."""
    import copy

    from angelspec_hf.errors import DrafterTargetMismatchError
    from angelspec_hf.reference import tiny_target

    trained_for = tiny_target("llama", num_hidden_layers=8, seed=0)
    export_eagle3(MTPDrafter.from_target(trained_for, draft_vocab_size=48), tmp_path)
    recorded = json.loads((tmp_path / "config.json").read_text())["angelspec_target"]
    renamed = copy.deepcopy(trained_for)
    renamed.config._name_or_path = "somewhere/else"
    loaded = load_eagle3(tmp_path, target=renamed)
    assert loaded.config.target_name_or_path == "tiny-llama-seed0"
    assert loaded.config.target_embedding_fingerprint == recorded["embedding_fingerprint"]
    shallower = copy.deepcopy(trained_for)
    shallower.model.layers = shallower.model.layers[:6]
    shallower.config.num_hidden_layers = 6
    with pytest.raises(DrafterTargetMismatchError, match="8 decoder layers recorded, the target has 6"):
        load_eagle3(tmp_path, target=shallower)


def test_a_full_vocabulary_file_with_its_own_head_needs_the_target(tmp_path):
    """Without the target, the stored lm_head of a full-vocabulary file was dropped in silence and the
    drafter drafted through whatever target it met; it is refused until the target can be compared."""
    from angelspec_hf.reference import tiny_target

    target = tiny_target("llama", num_hidden_layers=8, seed=0)  # EAGLE-3 reads three of its layers
    export_eagle3(MTPDrafter.from_target(target), tmp_path, target=target)
    assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")
    with pytest.raises(DrafterConfigError, match=r"own \(96, 64\) lm_head.*Fix: pass target="):
        load_eagle3(tmp_path, num_target_layers=target.config.num_hidden_layers)
    assert not load_eagle3(tmp_path, target=target).config.uses_reduced_vocab


def test_a_qk_norm_drafter_is_refused_by_the_export(tmp_path):
    from angelspec_hf.reference import tiny_target

    drafter = MTPDrafter.from_target(tiny_target("llama", num_hidden_layers=8, seed=0), draft_vocab_size=48, qk_norm=True)
    assert drafter.config.layer_style == "eagle3"
    with pytest.raises(DrafterConfigError, match="EAGLE-3 layers have no QK-norm.*angelspec-hf format"):
        export_eagle3(drafter, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
