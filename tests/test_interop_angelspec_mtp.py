"""AngelSpec's MTPDraftModel (DeepSeek-style MTP layer): round trips, the layer written out from the
published equations under their tensor names, the published configs, and clear refusals."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from angelspec_hf import MTPDrafter
from angelspec_hf.errors import DrafterCheckpointError, DrafterConfigError, DrafterTargetMismatchError
from angelspec_hf.interop import export_angelspec_mtp, export_eagle3, load_angelspec_mtp
from angelspec_hf.interop.angelspec_mtp import mtp_drafter_config
from fitting import same_generation

FORMATS = Path(__file__).resolve().parents[2] / "shared" / "data" / "formats"


@pytest.fixture(scope="module")
def exported(targets, tmp_path_factory):
    target, drafter = targets.target("llama"), targets.fitted("llama", "mtp-deepseek")
    path = tmp_path_factory.mktemp("mtp") / "angelspec-mtp"
    export_angelspec_mtp(drafter, path, target=target)
    return path


def test_export_then_load_is_the_same_drafter(targets, exported):
    target, drafter = targets.target("llama"), targets.fitted("llama", "mtp-deepseek")
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["MTPDraftModel"] and config["model_type"] == "mtp"
    assert config["mlp_type"] == "dense" and config["qk_norm"] is True and config["tie_lm_head"] is True
    names = set(load_file(exported / "model.safetensors"))
    assert {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight",
            "midlayer.mlp.down_proj.weight"} <= names
    assert not any(name.startswith("lm_head") for name in names)  # tied to the target's head
    loaded = load_angelspec_mtp(exported, target=target).eval()
    assert loaded.config.layer_style == "deepseek" and loaded.config.num_draft_tokens == drafter.config.num_draft_tokens
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert same_generation(target, drafter, loaded)
    # Our own exports record the target, so no target is needed to read them back.
    assert same_generation(target, drafter, load_angelspec_mtp(exported).eval())


def test_the_layer_matches_the_mtpdraftmodel_equations(targets, exported):
    """Two chained draft steps computed from the checkpoint's own tensors, as AngelSpec's
    MTPDraftModel.backbone does: position-0 embedding zeroed, eh_proj([enorm(e); hnorm(h)]),
    a pre-norm decoder layer with per-head QK-norm before RoPE, final_layernorm, tied lm_head;
    step 2 reads step 1's normed output."""
    target = targets.target("llama")
    loaded = load_angelspec_mtp(exported, target=target).eval()
    w = {k: v.float() for k, v in load_file(exported / "model.safetensors").items()}
    c = json.loads((exported / "config.json").read_text())
    heads, kv_heads, dim, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, positions):
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.cat([positions[:, None].float() * inv] * 2, -1)
        half = dim // 2
        return x * freqs.cos() + torch.cat([-x[..., half:], x[..., :half]], -1) * freqs.sin()

    def layer(tokens, hidden, positions, past):
        n = tokens.shape[1]
        e = w["embed_tokens.weight"][tokens] * (positions != 0)[None, :, None]
        x = torch.cat([rms(e, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        a = rms(x, w["midlayer.input_layernorm.weight"])
        q = rms((a @ w["midlayer.self_attn.q_proj.weight"].T).view(1, n, heads, dim), w["midlayer.self_attn.q_norm.weight"])
        k = rms((a @ w["midlayer.self_attn.k_proj.weight"].T).view(1, n, kv_heads, dim), w["midlayer.self_attn.k_norm.weight"])
        v = (a @ w["midlayer.self_attn.v_proj.weight"].T).view(1, n, kv_heads, dim).transpose(1, 2)
        q, k = rope(q.transpose(1, 2), positions), rope(k.transpose(1, 2), positions)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        keys, values = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        total = keys.shape[2]
        causal = torch.ones(n, total, dtype=torch.bool).tril(total - n)
        scores = (q @ keys.transpose(-1, -2)) * dim**-0.5
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ values
        x = x + attn.transpose(1, 2).reshape(1, n, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        m = rms(x, w["midlayer.post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
        return rms(x, w["final_layernorm.weight"]), (k, v)

    sequence = targets.sequences("llama")[:1, :8]
    with torch.no_grad():
        last_hidden = target.model(sequence).last_hidden_state  # final-normed, what the format is trained on
        positions = torch.arange(7)
        expected, past = layer(sequence[:, 1:8], last_hidden[:, :7], positions, None)
        next_token = (expected[:, -1:] @ target.lm_head.weight.T).argmax(-1)
        expected_next, _ = layer(next_token, expected[:, -1:], torch.tensor([7]), past)

        features = target(sequence, output_hidden_states=True).hidden_states
        fused = loaded.fuse([features[loaded.config.target_layer_ids[0] + 1][:, :7]])
        mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
        ours, present = loaded(fused, target.get_input_embeddings()(sequence[:, 1:8]), positions[None], None, mask)
        ours_next, _ = loaded(ours[:, -1:], target.get_input_embeddings()(next_token), torch.tensor([[7]]), present)
        assert torch.equal(loaded.logits(ours[:, -1:], target.lm_head).argmax(-1), next_token)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_next, expected_next, atol=1e-4, rtol=1e-4)


def test_published_mtp_configs():
    dense, moe = FORMATS / "angelspec_mtp_qwen3_8b_dense_draft_config.json", FORMATS / "angelspec_mtp_hy3_draft_config.json"
    if not dense.exists():
        pytest.skip(f"shared format examples not present ({dense})")
    raw = json.loads(dense.read_text())
    config = mtp_drafter_config(raw, num_target_layers=36)
    assert config.layer_style == "deepseek" and config.qk_norm and config.target_layer_ids == [35]
    assert (config.hidden_size, config.intermediate_size, config.num_key_value_heads, config.head_dim) == (4096, 12288, 8, 128)
    assert config.vocab_size == 151936 and not config.uses_reduced_vocab
    assert MTPDrafter(config.__class__(**{**config.to_dict(), "hidden_size": 64, "intermediate_size": 96,
                                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                          "vocab_size": 128})).self_attn.q_norm is not None
    with pytest.raises(DrafterConfigError, match="how deep its target is"):
        mtp_drafter_config(raw)
    with pytest.raises(DrafterConfigError, match="mixture-of-experts"):
        mtp_drafter_config(json.loads(moe.read_text()), num_target_layers=80)


def test_refusals(targets, exported, tmp_path):
    llama, qwen = targets.target("llama"), targets.target("qwen3")
    with pytest.raises(DrafterConfigError, match="DeepSeek-style MTP layer"):
        export_angelspec_mtp(targets.fitted("llama", "mtp"), tmp_path / "a", target=llama)
    with pytest.raises(DrafterConfigError, match="--to angelspec"):
        export_eagle3(targets.fitted("llama", "mtp-deepseek"), tmp_path / "b", target=llama)
    with pytest.raises(DrafterConfigError, match="pass the target"):
        export_angelspec_mtp(targets.fitted("llama", "mtp-deepseek"), tmp_path / "c", target=None)
    with pytest.raises(DrafterConfigError, match="reads only the target's last layer"):
        MTPDrafter.from_target(llama, layer_style="deepseek", target_layer_ids=[0, 1])
    # A checkpoint trained against other embeddings: refused at load with the target, at generate without.
    with pytest.raises(DrafterTargetMismatchError, match="other token embeddings"):
        load_angelspec_mtp(exported, target=qwen)
    raw = json.loads((exported / "config.json").read_text())
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    del raw["angelspec_target"]
    (foreign / "config.json").write_text(json.dumps(raw))
    tensors = load_file(exported / "model.safetensors")
    save_file(tensors, foreign / "model.safetensors")
    drafter = load_angelspec_mtp(foreign, num_target_layers=llama.config.num_hidden_layers)
    assert drafter.config.target_embedding_fingerprint  # taken from the stored embed_tokens
    drafter.check_target(llama)
    with pytest.raises(DrafterTargetMismatchError, match="embedding fingerprint"):
        drafter.check_target(qwen)
    tensors["midlayer.mlp.experts.0.up_proj.weight"] = torch.zeros(2)
    save_file(tensors, foreign / "model.safetensors")
    with pytest.raises(DrafterCheckpointError, match="not a dense AngelSpec MTPDraftModel"):
        load_angelspec_mtp(foreign, target=llama)


def test_convert_command_both_ways(targets, tmp_path):
    from angelspec_hf.cli import main

    target, drafter = targets.target("llama"), targets.fitted("llama", "mtp-deepseek")
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "ours")
    target_arg = ["--target", str(tmp_path / "target")]
    assert main(["convert", "--to", "angelspec", *target_arg, str(tmp_path / "ours"), str(tmp_path / "theirs")]) == 0
    assert json.loads((tmp_path / "theirs" / "config.json").read_text())["architectures"] == ["MTPDraftModel"]
    assert main(["convert", "--to", "angelspec-hf", *target_arg, str(tmp_path / "theirs"), str(tmp_path / "back")]) == 0
    back = MTPDrafter.from_pretrained(tmp_path / "back")
    assert back.config.layer_style == "deepseek"
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, back.state_dict()[key]), key
