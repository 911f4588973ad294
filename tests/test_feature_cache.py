"""Target states cached per training row: exact enough, keyed by target and layers, self-healing."""

import logging

import torch

from angelspec_hf import MTPDrafter
from angelspec_hf.training.features import FeatureCache, run_target
from angelspec_hf.training.recipes import Recipe, train_drafter
from conftest import PROMPT_LENGTH


def padded_batch(sequences, lengths):
    ids = sequences[: len(lengths)].clone()
    mask = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        ids[i, length:] = 0
        mask[i, :length] = 1
    return ids, mask, torch.tensor(lengths)


def test_cached_states_equal_fresh_ones(targets, tmp_path):
    target = targets.target("llama")
    layers = [0, 2]
    ids, mask, lengths = padded_batch(targets.sequences("llama"), [30, 46, 21])
    cache = FeatureCache(tmp_path, target, layers)
    fresh_features, fresh_final = run_target(target, ids, mask, layers)
    first = cache.states(target, ids, mask, lengths, torch.float32)
    assert (cache.hits, cache.misses) == (0, 3)
    calls = []
    hook = target.register_forward_hook(lambda *_: calls.append(1))
    base_hook = target.base_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        features, final = cache.states(target, ids, mask, lengths, torch.float32)
    finally:
        hook.remove()
        base_hook.remove()
    assert not calls and (cache.hits, cache.misses) == (3, 3)
    for i, length in enumerate(lengths.tolist()):
        for cached, fresh in zip([*features, final], [*fresh_features, fresh_final]):
            torch.testing.assert_close(cached[i, :length], fresh[i, :length], atol=2e-3, rtol=2e-3)
            assert not cached[i, length:].any()
    assert torch.equal(first[1], fresh_final)  # a miss returns the target's own states
    # Another layer list or another target never reads these files.
    assert FeatureCache(tmp_path, target, [1, 2]).directory != cache.directory
    assert FeatureCache(tmp_path, targets.target("qwen3"), layers).directory != cache.directory


def test_unreadable_files_are_recomputed(targets, tmp_path, caplog):
    target = targets.target("llama")
    ids, mask, lengths = padded_batch(targets.sequences("llama"), [25])
    cache = FeatureCache(tmp_path, target, [1])
    cache.states(target, ids, mask, lengths, torch.float32)
    (path,) = list(cache.directory.rglob("*.safetensors"))
    path.write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING, logger="angelspec_hf.training.features"):
        features, _ = cache.states(target, ids, mask, lengths, torch.float32)
    assert "Unreadable cached target states" in caplog.text and cache.misses == 2
    assert cache.load(ids[0, :25]) is not None  # rewritten
    torch.testing.assert_close(features[0], run_target(target, ids, mask, [1])[0][0])


def test_training_with_a_cache_runs_the_target_once_per_row(targets, tmp_path):
    target = targets.target("llama")
    rows = [{"input_ids": row.tolist(), "loss_start": PROMPT_LENGTH} for row in targets.sequences("llama")[:6]]
    forwards = []
    # Forwards over training batches (3 rows); each run also checks the target's logits on a 1-row probe.
    hook = target.base_model.register_forward_hook(
        lambda module, args, kwargs, output: forwards.append(1) if kwargs["input_ids"].shape[0] == 3 else None,
        with_kwargs=True)
    try:
        for run in ("first", "second"):
            recipe = Recipe(name="mtp-chat", num_draft_tokens=2, lk_steps=6, tv_steps=3, batch_size=3,
                            logging_steps=3, feature_cache=str(tmp_path / "cache"))
            drafter = train_drafter(target, rows, tmp_path / run, recipe, pad_token_id=0)
            if run == "first":
                assert len(forwards) == 2  # 6 rows in batches of 3: every later step reads the cache
    finally:
        hook.remove()
    assert len(forwards) == 2 and isinstance(drafter, MTPDrafter)


def test_a_cache_of_more_layers_serves_a_drafter_reading_fewer(targets, tmp_path):
    """States of layers [0, 2] are read, sliced, from a cache of [0, 1, 2] of the same target
    without running it; a cache of other layers or of another target is not read."""
    target = targets.target("llama")
    ids, mask, lengths = padded_batch(targets.sequences("llama"), [30, 46])
    FeatureCache(tmp_path, target, [0, 1, 2]).states(target, ids, mask, lengths, torch.float32)
    subset = FeatureCache(tmp_path, target, [2, 0])
    calls = []
    hook = target.base_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        features, final = subset.states(target, ids, mask, lengths, torch.float32)
    finally:
        hook.remove()
    assert not calls and (subset.hits, subset.misses) == (2, 0)
    assert not list(subset.directory.rglob("*.safetensors"))  # read in place, not copied
    fresh_features, fresh_final = run_target(target, ids, mask, [2, 0])
    for i, length in enumerate(lengths.tolist()):
        for cached, fresh in zip([*features, final], [*fresh_features, fresh_final]):
            torch.testing.assert_close(cached[i, :length], fresh[i, :length], atol=2e-3, rtol=2e-3)
    other_layers = FeatureCache(tmp_path, target, [0, 3])
    other_layers.states(target, ids, mask, lengths, torch.float32)
    assert other_layers.misses == 2
    other_target = targets.target("qwen3")
    other_ids, other_mask, other_lengths = padded_batch(targets.sequences("qwen3"), [30])
    elsewhere = FeatureCache(tmp_path, other_target, [0, 2])
    assert not elsewhere.supersets
    elsewhere.states(other_target, other_ids, other_mask, other_lengths, torch.float32)
    assert elsewhere.misses == 1


def test_a_fine_tune_or_another_config_under_the_same_name_never_reads_the_base_models_states(tmp_path):
    """Name and embeddings alone keyed the cache: a fine-tune saved over the same path with frozen
    embeddings, or the same weights with another rope_theta, hit every row of the base model's states."""
    from angelspec_hf.reference import tiny_target

    base = tiny_target("llama", seed=0)
    tuned = tiny_target("llama", seed=0)
    with torch.no_grad():
        tuned.model.layers[2].mlp.down_proj.weight.mul_(1.5)  # the embeddings stay: same name and fingerprint
    other_rope = tiny_target("llama", seed=0, rope_theta=100.0)
    row = torch.arange(3, 19)[None]
    mask, lengths = torch.ones_like(row), torch.tensor([row.shape[1]])
    layers = [1, 3]
    FeatureCache(tmp_path, base, layers).states(base, row, mask, lengths, torch.float32)
    for model in (tuned, other_rope):
        cache = FeatureCache(tmp_path, model, layers)
        features, _ = cache.states(model, row, mask, lengths, torch.float32)
        assert cache.hits == 0 and cache.misses == 1
        own, _ = run_target(model, row, mask, layers)
        assert torch.allclose(features[1], own[1], atol=1e-3)
    assert FeatureCache(tmp_path, tiny_target("llama", seed=0), layers).directory == FeatureCache(tmp_path, base, layers).directory
