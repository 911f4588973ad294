"""Each misuse gets a typed error that names the problem and the fix."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, DynamicCache, StaticCache

from angelspec_hf import DFlyDrafter, MTPDrafter
from angelspec_hf.errors import (
    BatchSizeNotSupportedError,
    DrafterConfigError,
    DrafterCheckpointError,
    DrafterTargetMismatchError,
    UnsupportedCacheError,
    UnsupportedGenerationModeError,
)
from angelspec_hf.reference import tiny_target

PROMPT = torch.tensor([[5, 9, 11, 4, 7]])


def generate(target, drafter, prompt=PROMPT, **kwargs):
    return target.generate(prompt, assistant_model=drafter, max_new_tokens=6, do_sample=False, eos_token_id=None, **kwargs)


@pytest.mark.parametrize(
    "other_target, problem",
    [
        (lambda: tiny_target("llama", vocab_size=128), "vocabulary size: drafter expects 96, target has 128"),
        (lambda: tiny_target("llama", hidden_size=32), "hidden size"),
        (lambda: tiny_target("llama", num_hidden_layers=8), "decoder layer count"),
        (lambda: tiny_target("llama", seed=99), "embedding fingerprint"),
    ],
)
def test_drafter_built_for_another_target(targets, other_target, problem):
    drafter = DFlyDrafter.from_target(targets.target("llama"))
    with pytest.raises(DrafterTargetMismatchError, match=problem) as info:
        generate(other_target(), drafter)
    assert "tiny-llama-seed0" in str(info.value) and "from_target" in str(info.value)


def test_batch_size_above_one(targets):
    target = targets.target("llama")
    with pytest.raises(BatchSizeNotSupportedError, match="once per prompt"):
        generate(target, MTPDrafter.from_target(target), prompt=PROMPT.repeat(2, 1), attention_mask=torch.ones(2, 5))


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
@pytest.mark.parametrize("beams", [{"num_beams": 2}, {"num_beams": 3, "do_sample": True}])
def test_beam_search_is_refused_not_run_without_the_drafter(targets, kind, beams):
    # transformers would warn and run plain beam search, the drafter unused.
    target = targets.target("llama")
    drafter = MTPDrafter.from_target(target) if kind == "mtp" else DFlyDrafter.from_target(target)
    options = {"do_sample": False, **beams}
    with pytest.raises(UnsupportedGenerationModeError, match="drop num_beams") as info:
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=6, eos_token_id=None, **options)
    assert f"num_beams={beams['num_beams']}" in str(info.value)
    generate(target, drafter, num_beams=1)


def test_static_cache_and_disabled_cache(targets):
    target = targets.target("llama")
    drafter = MTPDrafter.from_target(target)
    with pytest.raises(UnsupportedCacheError, match="DynamicCache"):
        generate(target, drafter, cache_implementation="static")
    with pytest.raises(UnsupportedCacheError, match="DynamicCache"):
        generate(target, drafter, past_key_values=StaticCache(config=target.config, max_cache_len=64))
    with pytest.raises(UnsupportedCacheError, match="use_cache"):
        generate(target, drafter, use_cache=False)
    # The default dynamic cache, passed explicitly, is fine.
    generate(target, drafter, past_key_values=DynamicCache(config=target.config))


@pytest.fixture
def saved_drafter(targets, tmp_path):
    DFlyDrafter.from_target(targets.target("llama")).save_pretrained(tmp_path)
    return tmp_path


def test_missing_weights_file(saved_drafter):
    (saved_drafter / "model.safetensors").unlink()
    with pytest.raises(DrafterCheckpointError, match="model.safetensors"):
        AutoModel.from_pretrained(saved_drafter)


def test_corrupt_weights_file(saved_drafter):
    weights = saved_drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    with pytest.raises(DrafterCheckpointError, match="corrupt"):
        DFlyDrafter.from_pretrained(saved_drafter)


def test_missing_and_unexpected_tensors(saved_drafter):
    weights = saved_drafter / "model.safetensors"
    tensors = load_file(weights)
    tensors.pop("layers.0.q_proj.weight")
    tensors["stray.weight"] = torch.zeros(2)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(DrafterCheckpointError, match=r"missing_keys: \['layers.0.q_proj.weight'\].*unexpected_keys"):
        AutoModel.from_pretrained(saved_drafter)


def test_pickle_checkpoints_are_not_read(saved_drafter):
    tensors = load_file(saved_drafter / "model.safetensors")
    (saved_drafter / "model.safetensors").unlink()
    torch.save(tensors, saved_drafter / "pytorch_model.bin")
    with pytest.raises(DrafterCheckpointError):
        DFlyDrafter.from_pretrained(saved_drafter)


def test_corrupt_config(saved_drafter):
    config = json.loads((saved_drafter / "config.json").read_text())
    config["conditioning"] = "sideways"
    (saved_drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="conditioning must be one of"):
        AutoModel.from_pretrained(saved_drafter)


@pytest.mark.parametrize("field", ["mask_token_id", "block_size", "target_layer_ids", "target_embedding_fingerprint",
                                   "vocab_size"])
def test_a_config_missing_what_a_saved_drafter_records_is_refused(saved_drafter, field):
    """Missing, these took class defaults: another network (mask 0, block 8, default layers, a vocabulary
    of 32000) or, without the fingerprint, no wrong-target check at all."""
    config = json.loads((saved_drafter / "config.json").read_text())
    del config[field]
    (saved_drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterCheckpointError, match=rf"lacks \['{field}'\].*re-save"):
        AutoModel.from_pretrained(saved_drafter)


@pytest.mark.parametrize("field, value", [("rms_norm_eps", "1e-5"), ("rms_norm_eps", None), ("rms_norm_eps", -1.0),
                                          ("rope_theta", 0.0), ("rope_theta", "10000"),
                                          ("correction_intermediate_size", "64"), ("target_embedding_fingerprint", "x")])
def test_config_values_of_the_wrong_type_or_range_are_named(saved_drafter, field, value):
    """They loaded and failed in generate with a bare TypeError, or drafted garbage (a negative epsilon)."""
    config = json.loads((saved_drafter / "config.json").read_text())
    config[field] = value
    (saved_drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterConfigError, match=field):
        AutoModel.from_pretrained(saved_drafter)


@pytest.mark.parametrize("kind, buffer", [("dfly", "draft_vocab"), ("mtp", "d2t")])
@pytest.mark.parametrize("damage", ["past the vocabulary", "negative", "twice"])
def test_a_draft_vocabulary_outside_the_target_or_repeated_is_refused_at_load(targets, tmp_path, kind, buffer, damage):
    """Out-of-range ids loaded and failed in generate with a bare IndexError."""
    target = targets.target("llama")
    ids = torch.arange(10, 58)
    drafter = (DFlyDrafter.from_target(target, draft_token_ids=ids) if kind == "dfly"
               else MTPDrafter.from_target(target, draft_token_ids=ids))
    drafter.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    stored = tensors[buffer].clone()
    if damage == "past the vocabulary":
        stored[-1] += 1000
    elif damage == "negative":
        stored[0] -= 1000
    else:  # the second id made to name the first one's token
        stored[1] = stored[0] if kind == "dfly" else stored[0] - 1
    tensors[buffer] = stored
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    problem = "more than once" if damage == "twice" else "outside the target's 0..95"
    with pytest.raises(DrafterCheckpointError, match=rf"draft vocabulary stored at .* {buffer} .*names token ids .*{problem}"
                                                     ".*Fix: re-save"):
        AutoModel.from_pretrained(tmp_path)


def test_an_mtp_t2d_that_disagrees_with_d2t_is_refused_at_load(targets, tmp_path):
    """An EAGLE-3 export ships t2d beside d2t; one that marks other tokens loaded without a word."""
    MTPDrafter.from_target(targets.target("llama"), draft_token_ids=torch.arange(10, 58)).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["t2d"] = torch.roll(tensors["t2d"], 1)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DrafterCheckpointError, match="t2d does not mark exactly the target ids that d2t maps to"):
        AutoModel.from_pretrained(tmp_path)


def save_with_config(drafter, directory, **changes):
    """Save ``drafter`` and rewrite fields of its config.json as a hand edit or a broken tool would."""
    drafter.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("kind, field, value, message", [
    # A JSON string "false" is truthy: the module ran switched on.
    ("dfly", "hidden_correction", "false", "hidden_correction must be true or false"),
    ("dfly", "correction_embed_norm", "false", "correction_embed_norm must be true or false"),
    ("mtp", "qk_norm", "false", "qk_norm must be true or false"),
    ("dfly", "initializer_range", "0.02", "initializer_range must be a positive number"),
    ("mtp", "initializer_range", -0.02, "initializer_range must be a positive number"),
    ("dfly", "num_hidden_layers", True, "num_hidden_layers must be a positive integer"),
    ("mtp", "target_name_or_path", 5, "target_name_or_path must be a string"),
    # Of another length the fingerprint never matched: every target, the right one too, was refused.
    ("dfly", "target_embedding_fingerprint", [0.5] * 10, "has 10 values, not the 128"),
    ("mtp", "target_layer_ids", [1.0, 4.0, 5.0], r"target_layer_ids must be integers .*\[1.0, 4.0, 5.0\]"),
])
def test_config_values_of_the_wrong_type_are_named_with_their_type(targets, tmp_path, kind, field, value, message):
    target = targets.target("llama")
    drafter = DFlyDrafter.from_target(target) if kind == "dfly" else MTPDrafter.from_target(target)
    with pytest.raises(DrafterConfigError, match=message):
        AutoModel.from_pretrained(save_with_config(drafter, tmp_path, **{field: value}))


def test_a_directory_without_config_json_is_named(saved_drafter):
    """transformers reads a missing config.json as {}: the error listed every field as missing."""
    (saved_drafter / "config.json").unlink()
    with pytest.raises(DrafterCheckpointError, match="config.json is missing or empty"):
        DFlyDrafter.from_pretrained(saved_drafter)


@pytest.mark.parametrize("argument, message", [({"dtype": "float33"}, "dtype"), ({"device_map": "nowhere"}, "device_map")])
def test_a_bad_from_pretrained_argument_is_not_blamed_on_the_checkpoint(saved_drafter, argument, message):
    """It was wrapped in DrafterCheckpointError with a "re-download or re-save" fix: the files were fine."""
    with pytest.raises(ValueError, match=message) as info:
        DFlyDrafter.from_pretrained(saved_drafter, **argument)
    assert not isinstance(info.value, DrafterCheckpointError)


def test_a_tensor_of_the_wrong_shape_is_named(saved_drafter):
    """It came as transformers' "ignore_mismatched_sizes" RuntimeError text, naming no tensor."""
    weights = saved_drafter / "model.safetensors"
    tensors = load_file(weights)
    tensors["layers.0.q_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(DrafterCheckpointError, match=r"mismatched_keys: .*layers.0.q_proj.weight.*\[3, 3\]"):
        DFlyDrafter.from_pretrained(saved_drafter)


def test_an_unreadable_weight_index_is_still_a_checkpoint_error(saved_drafter):
    """A JSONDecodeError (a ValueError) from a file stays a checkpoint error after bad arguments stopped being one."""
    (saved_drafter / "model.safetensors").rename(saved_drafter / "model-00001-of-00001.safetensors")
    (saved_drafter / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(DrafterCheckpointError, match="re-download or re-save"):
        DFlyDrafter.from_pretrained(saved_drafter)


@pytest.mark.parametrize("native_bf16, drafter_dtype, warns", [
    (False, torch.bfloat16, True), (True, torch.bfloat16, False), (False, torch.float32, False)])
def test_drafting_in_emulated_bfloat16_warns_once_with_the_fix(targets, monkeypatch, caplog, native_bf16,
                                                                 drafter_dtype, warns):
    from angelspec_hf import modeling_angelspec_common as common

    monkeypatch.setattr(common, "cpu_has_bfloat16_units", lambda: native_bf16)
    target = targets.target("llama")
    drafter = DFlyDrafter.from_target(target).to(drafter_dtype)
    plain = target.generate(PROMPT, max_new_tokens=6, do_sample=False, eos_token_id=None)
    with caplog.at_level("WARNING", logger=common.logger.name):
        outputs = [generate(target, drafter) for _ in range(2)]
    messages = [r.getMessage() for r in caplog.records if "drafts in" in r.getMessage()]
    # A slower draft, never other tokens: the target verifies.
    assert all(torch.equal(out, plain) for out in outputs)
    assert len(messages) == (1 if warns else 0)
    if warns:
        assert "torch.bfloat16" in messages[0] and "dtype=target.dtype" in messages[0]
