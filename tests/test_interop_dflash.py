"""The z-lab DFlash format: round trip, the published config, and the real `dflash` package as peer."""

import json
from pathlib import Path

import pytest
import torch

from angelspec_hf import DFlyDrafter
from angelspec_hf.errors import DrafterCheckpointError, DrafterConfigError
from angelspec_hf.interop import export_dflash, load_dflash
from angelspec_hf.benchmark import transformers_dflash_assistant
from angelspec_hf.interop.dflash import dflash_drafter_config
from conftest import PROMPT_LENGTH

FORMATS = Path(__file__).resolve().parents[2] / "shared" / "data" / "formats"


def test_export_then_load_is_the_same_drafter(targets, tmp_path):
    target, drafter = targets.target("llama"), targets.fitted("llama", "dfly-global-nocorr")
    export_dflash(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": drafter.config.mask_token_id,
                                       "target_layer_ids": drafter.config.target_layer_ids}
    loaded = load_dflash(tmp_path).eval()
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key])
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    a = target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, eos_token_id=None)
    stats = drafter.last_speculation_stats.as_dict()
    b = target.generate(prompt, assistant_model=loaded, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(a, b) and loaded.last_speculation_stats.as_dict() == stats


def test_dfly_with_its_own_parts_is_refused(targets, tmp_path):
    with pytest.raises(DrafterConfigError, match="Only DFlash-mode"):
        export_dflash(targets.fitted("llama", "dfly-hybrid-corr"), tmp_path)


def test_published_dflash_configs_are_read():
    for name in ("specforge_qwen3-8b-dflash.json", "specforge_qwen2.5-0.5b-dflash.json"):
        path = FORMATS / name
        if not path.exists():
            pytest.skip(f"shared format examples not present ({path})")
        raw = json.loads(path.read_text())
        config = dflash_drafter_config(raw)
        assert config.variant == "dflash"
        assert config.target_layer_ids == (raw.get("dflash_config") or raw)["target_layer_ids"]
        assert config.num_hidden_layers == raw["num_hidden_layers"] and config.block_size == raw["block_size"]


def test_a_dflash2_checkpoint_is_refused_clearly(targets, tmp_path):
    export_dflash(targets.fitted("llama", "dfly-global-nocorr"), tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors["candidate_selector.hidden_projection.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(DrafterCheckpointError, match="not a plain DFlash checkpoint"):
        load_dflash(tmp_path)


def test_the_dflash_package_loads_our_export_strictly_and_drafts_the_same(targets, tmp_path, monkeypatch):
    """Our DFlash-mode drafter, the z-lab dflash package and transformers' own DFlash path on the same
    weights: the same output, and the same tokens per round.

    Two implementations of one drafter are not bitwise equal, so a draft token whose two best
    logits are nearly tied can go either way: on an Intel Xeon with AMX (session 59; float64 gave the
    same) one round of the package's drafted one token fewer and the next one more. Rounds are
    compared as sequences that may trade at most one token between two neighbouring rounds once
    over the four prompts. Ours verifies the chain alone (no first-token alternatives), as the other
    two do: an alternative the target takes in a round makes the rounds differ (on an AMD EPYC in
    session 63 the last, one-token round of a prompt won an alternative, 10 rounds against 11)."""
    dflash_model = pytest.importorskip("dflash.model")
    from angelspec_hf.evaluation import alternatives_set
    import time

    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # its stats timer assumes CUDA
    target, drafter = targets.target("llama"), targets.fitted("llama", "dfly-global-nocorr")
    export_dflash(drafter, tmp_path)
    peer, info = dflash_model.DFlashDraftModel.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.float32)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    peer.eval()
    native = transformers_dflash_assistant(drafter, torch.float32)
    traded = 0
    for row in targets.sequences("llama")[:4]:
        prompt = row[None, :PROMPT_LENGTH]
        with alternatives_set(drafter, 0):
            ours = target.generate(prompt, assistant_model=drafter, max_new_tokens=30, do_sample=False, eos_token_id=None)
        assert drafter.last_speculation_stats.alternative_hits == 0
        with torch.no_grad():
            theirs = dflash_model.dflash_generate(peer, target, prompt, max_new_tokens=30, stop_token_ids=None,
                                                  return_stats=True)
        assert torch.equal(theirs.output_ids, ours)
        our_rounds = [a + 1 for a in drafter.last_speculation_stats.accepted]
        # Same weights, same drafts: the same tokens per round. Only the last rounds may differ,
        # where the two loops size the final draft to the length limit differently.
        compared = len(theirs.acceptance_lengths) - 2
        mine, peers = our_rounds[:compared], theirs.acceptance_lengths[:compared]
        assert len(our_rounds) > 3 and len(mine) == len(peers)
        differing = [i for i, (a, b) in enumerate(zip(mine, peers)) if a != b]
        if differing:  # one traded token: two neighbouring rounds, or the last compared one (its partner uncompared)
            first = differing[0]
            assert differing == [compared - 1] or (
                differing == [first, first + 1] and mine[first] + mine[first + 1] == peers[first] + peers[first + 1]), (mine, peers)
            traded += 1
        forwards = []
        hook = target.register_forward_hook(lambda *_: forwards.append(1))
        try:
            theirs_native = target.generate(prompt, assistant_model=native, speculation_type="dflash", max_new_tokens=30,
                                            do_sample=False, eos_token_id=None)
        finally:
            hook.remove()
        # transformers' loop: the prefill forward, then one verify forward per round.
        assert torch.equal(theirs_native, ours) and len(forwards) == len(our_rounds) + 1
    assert traded <= 1


def test_convert_command_both_ways(targets, tmp_path):
    from angelspec_hf.cli import main

    targets.fitted("llama", "dfly-global-nocorr").save_pretrained(tmp_path / "ours")
    assert main(["convert", "--to", "dflash", str(tmp_path / "ours"), str(tmp_path / "zlab")]) == 0
    assert main(["convert", "--to", "angelspec-hf", str(tmp_path / "zlab"), str(tmp_path / "back")]) == 0
    back = DFlyDrafter.from_pretrained(tmp_path / "back")
    original = DFlyDrafter.from_pretrained(tmp_path / "ours")
    for key, value in original.state_dict().items():
        assert torch.equal(value, back.state_dict()[key])
    assert back.config.target_embedding_fingerprint == original.config.target_embedding_fingerprint


def test_transformers_own_dflash_path_reproduces_our_drafts(targets, tmp_path):
    """The export runs through transformers' speculation_type="dflash" with its own assistant class:
    same tokens, and the same number of target forwards (so the same acceptance every round) as our
    chain (first-token alternatives, which transformers' path lacks, off)."""
    from transformers import AutoModel

    from angelspec_hf.evaluation import alternatives_set
    from angelspec_hf.interop import export_transformers_dflash

    target, drafter = targets.target("llama"), targets.fitted("llama", "dfly-global-nocorr")
    export_transformers_dflash(drafter, tmp_path)
    theirs = AutoModel.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == "MuseGlimmerAssistantModel"
    calls = []
    hook = target.register_forward_hook(lambda *args: calls.append(1))
    try:
        for prompt in targets.sequences("llama")[:3, :PROMPT_LENGTH]:
            prompt = prompt[None]
            calls.clear()
            with alternatives_set(drafter, 0):
                ours = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                                       eos_token_id=None)
            our_forwards = len(calls)
            calls.clear()
            native = target.generate(prompt, assistant_model=theirs, speculation_type="dflash", max_new_tokens=24,
                                     do_sample=False, eos_token_id=None)
            assert torch.equal(ours, native)
            assert len(calls) == our_forwards, (len(calls), our_forwards)
            assert sum(drafter.last_speculation_stats.accepted) > 0
    finally:
        hook.remove()


def test_angelspec_dflash_config_is_read_by_both_readers():
    """AngelSpec's own DFlashDraftModel config counts the fused layers in num_target_layers (5) and the
    target's depth in target_num_hidden_layers (36): load_dflash read 5 as the depth and refused the
    layer ids, and load_angelspec sent it back to load_dflash."""
    from angelspec_hf.interop.angelspec import angelspec_drafter_config

    path = FORMATS / "angelspec_dflash_draft_config.json"
    if not path.exists():
        pytest.skip(f"shared format examples not present ({path})")
    raw = json.loads(path.read_text())
    with pytest.raises(DrafterConfigError, match="block size"):
        dflash_drafter_config(raw)
    for config in (dflash_drafter_config(raw, block_size=16), angelspec_drafter_config(raw, block_size=16)):
        assert config.variant == "dflash" and config.num_target_layers == 36
        assert config.target_layer_ids == [1, 9, 17, 25, 33] and config.mask_token_id == 151669


def test_an_angelspec_dflash_checkpoint_loads_as_the_same_drafter(tmp_path):
    """A checkpoint in AngelSpec's DFlash layout (its config and tensor names, as its DFlashDraftModel
    saves them) loads through load_dflash, which the CLI picks for DFlashDraftModel, and load_angelspec."""
    from safetensors.torch import save_file

    from angelspec_hf.interop import load_angelspec
    from angelspec_hf.interop.angelspec import their_name
    from angelspec_hf.reference import tiny_target

    target = tiny_target("llama", seed=0)
    drafter = DFlyDrafter.from_target(target, block_size=4, conditioning="global", hidden_correction=False)
    c = drafter.config
    tensors = {their_name(key): value for key, value in drafter.state_dict().items()}
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()  # AngelSpec keeps it
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "dflash", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "num_target_layers": len(c.target_layer_ids), "target_hidden_size": c.hidden_size,
        "target_num_hidden_layers": c.num_target_layers, "target_layer_ids": c.target_layer_ids,
        "mask_token_id": c.mask_token_id, "tie_word_embeddings": False,
    }))
    for loaded in (load_dflash(tmp_path, block_size=4), load_angelspec(tmp_path, block_size=4)):
        assert loaded.config.variant == "dflash" and loaded.config.num_target_layers == c.num_target_layers
        assert loaded.config.target_layer_ids == c.target_layer_ids and loaded.config.block_size == 4
        for key, value in drafter.state_dict().items():
            assert torch.equal(value, loaded.state_dict()[key]), key
        loaded.check_target(target)
