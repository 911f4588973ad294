"""Prompt splits and rollout generation."""

import json

import pytest
import torch

from angelspec_hf.prompts import domain_prompts, load_prompts
from angelspec_hf.training.data import chat_prefix_ids, generate_rollouts, record_row, rollout_sequences
from fitting import tiny_tokenizer


def test_eval_and_train_splits_are_disjoint_and_complete():
    for name, rows in (("humaneval", 123), ("mbpp", 193), ("gsm8k", 750), ("mtbench", 60)):
        train, held_out, everything = (load_prompts(name, split) for split in ("train", "eval", "all"))
        assert len(everything) == rows and len(held_out) == (rows + 3) // 4
        assert not set(train) & set(held_out)
        assert sorted(train + held_out) == sorted(everything)
    assert len(domain_prompts("code", "eval", per_set=5)) == 10


def test_rollouts_are_resumable_without_duplicates(targets, tmp_path):
    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    prompts = [" ".join(f"w{(7 * i + j) % 90 + 6}" for j in range(3 + i % 4)) for i in range(7)]
    out = tmp_path / "rollouts.jsonl"
    generate_rollouts(target, tokenizer, prompts[:5], out, max_new_tokens=12, batch_size=1, domain="code")
    first = [json.loads(line) for line in out.read_text().splitlines()]
    generate_rollouts(target, tokenizer, prompts, out, max_new_tokens=12, batch_size=1, domain="code")
    assert chat_prefix_ids(tokenizer, "w6 w13")[1:3] == [6, 13]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[: len(first)] == first and len(rows) == 7
    assert sorted(row["prompt"] for row in rows) == sorted(prompts)
    for row in rows:
        prefix = chat_prefix_ids(tokenizer, row["prompt"])
        assert row["prompt_ids"] == prefix and row["domain"] == "code"
        # Rollouts are the target's own greedy continuation of the chat-formatted prompt.
        prefix_ids = torch.tensor([prefix])
        alone = target.generate(prefix_ids, attention_mask=torch.ones_like(prefix_ids), max_new_tokens=12,
                                do_sample=False, pad_token_id=0)
        expected = alone[0, len(prefix):].tolist()
        if 2 in expected:
            expected = expected[: expected.index(2) + 1]
        assert row["response_ids"] == expected
    batched = tmp_path / "batched.jsonl"
    generate_rollouts(target, tokenizer, prompts, batched, max_new_tokens=12, batch_size=3)
    # Batching changes nothing: same prompts, same prompt ids, bounded responses.
    batched_rows = {json.loads(line)["prompt"]: json.loads(line) for line in batched.read_text().splitlines()}
    assert set(batched_rows) == set(prompts)
    assert all(batched_rows[row["prompt"]]["prompt_ids"] == row["prompt_ids"] for row in rows)
    assert all(0 < len(row["response_ids"]) <= 12 for row in batched_rows.values())
    # Continuous batching decodes the same tokens as one prompt at a time.
    assert all(batched_rows[row["prompt"]]["response_ids"] == row["response_ids"] for row in rows)
    sequences = rollout_sequences([out], seq_len=64)
    assert all(seq["loss_start"] == len(chat_prefix_ids(tokenizer, row["prompt"])) for seq, row in zip(sequences, rows))


def test_interrupted_rollouts_keep_every_finished_row(targets, tmp_path, monkeypatch):
    from angelspec_hf.generation.engine import SpeculativeEngine

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    prompts = [" ".join(f"w{(3 * i + j) % 90 + 6}" for j in range(2 + i % 3)) for i in range(7)]
    out = tmp_path / "rollouts.jsonl"
    step, steps = SpeculativeEngine.step, []

    def interrupted_step(engine):
        if len(steps) == 20:
            raise KeyboardInterrupt
        steps.append(1)
        return step(engine)

    monkeypatch.setattr(SpeculativeEngine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        generate_rollouts(target, tokenizer, prompts, out, max_new_tokens=8, batch_size=2)
    # 20 steps of 2 rows finish some requests of 8 tokens, not all 7: those are on disk already.
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert 0 < len(kept) < len(prompts)
    monkeypatch.setattr(SpeculativeEngine, "step", step)
    generate_rollouts(target, tokenizer, prompts, out, max_new_tokens=8, batch_size=2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[: len(kept)] == kept and sorted(row["prompt"] for row in rows) == sorted(prompts)
    fresh = tmp_path / "fresh.jsonl"
    generate_rollouts(target, tokenizer, prompts, fresh, max_new_tokens=8, batch_size=2)
    by_prompt = {row["prompt"]: row for row in map(json.loads, fresh.read_text().splitlines())}
    assert all(by_prompt[row["prompt"]] == row for row in rows)


def test_rollouts_cut_inside_a_row_resume_with_that_row_generated_again(targets, tmp_path, caplog):
    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    prompts = [" ".join(f"w{(5 * i + j) % 90 + 6}" for j in range(2 + i % 3)) for i in range(4)]
    out = tmp_path / "rollouts.jsonl"
    generate_rollouts(target, tokenizer, prompts[:3], out, max_new_tokens=6, batch_size=2)
    whole = out.read_bytes()
    last = whole[: -1].rfind(b"\n") + 1
    # A run killed while writing its third row: half of it on disk, no newline.
    out.write_bytes(whole[: last + (len(whole) - last) // 2])
    kept = [json.loads(line) for line in whole[:last].decode().splitlines()]
    with caplog.at_level("WARNING"):
        assert len(rollout_sequences([out], seq_len=64)) <= 2  # training reads the whole rows only
    assert "ends inside a row" in caplog.text
    generate_rollouts(target, tokenizer, prompts, out, max_new_tokens=6, batch_size=2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[:2] == kept and sorted(row["prompt"] for row in rows) == sorted(prompts)
    out.write_text(out.read_text().replace("}\n", "\n", 1))
    with pytest.raises(ValueError, match="line 1, is not a JSON row"):
        rollout_sequences([out], seq_len=64)


def test_rollouts_keep_the_states_they_decode_for_training(targets, tmp_path):
    from angelspec_hf.training.features import FeatureCache, run_target

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    prompts = [" ".join(f"w{(5 * i + j) % 90 + 6}" for j in range(2 + i % 5)) for i in range(5)]
    caches = [FeatureCache(tmp_path / "cache", target, [0]), FeatureCache(tmp_path / "cache", target, [1, 0])]
    out = tmp_path / "rollouts.jsonl"
    # seq_len cuts the longer rows: the cache holds the rows exactly as training frames them.
    generate_rollouts(target, tokenizer, prompts, out, max_new_tokens=10, batch_size=2, feature_caches=caches, seq_len=14)
    rows = [record_row(json.loads(line), 14) for line in out.read_text().splitlines()]
    assert any(len(row["input_ids"]) == 14 for row in rows)
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        features, final = run_target(target, ids, torch.ones_like(ids), [0, 1])
        for cache, picks in zip(caches, ([0], [1, 0])):
            stored = cache.load(ids[0])
            assert stored is not None, "every rollout row is cached while decoding"
            torch.testing.assert_close(stored[0].float(), torch.stack([features[i][0] for i in picks]), atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(stored[1].float(), final[0], atol=2e-3, rtol=2e-3)


def test_magpie_prompts_come_from_the_empty_user_header(targets):
    # The tiny random target ends a sampled turn within 40 tokens only now and then, so each call may
    # draw up to 64 turns (the default 4 per prompt depends on the random stream's luck).
    from angelspec_hf.training.data import synthesize_chat_prompts, user_turn_prefix_ids

    tokenizer = tiny_tokenizer()
    assert user_turn_prefix_ids(tokenizer) == [3]  # the tiny template's user header is "w3 "
    prompts = synthesize_chat_prompts(targets.target("llama"), tokenizer, count=5, batch_size=8, max_new_tokens=40,
                                      min_chars=3, max_samples=64)
    assert len(prompts) == 5 and len(set(prompts)) == 5
    assert all(prompt.strip() == prompt and "</s>" not in prompt for prompt in prompts)
    # A later run keeps the list, adds new turns (a new seed) and never returns an excluded one.
    grown = synthesize_chat_prompts(targets.target("llama"), tokenizer, count=8, batch_size=8, max_new_tokens=40,
                                    min_chars=3, existing=prompts, exclude={prompts[0] + "x"}, max_samples=64)
    assert grown[:5] == prompts and len(set(grown)) == 8 and prompts[0] + "x" not in grown
    excluded = synthesize_chat_prompts(targets.target("llama"), tokenizer, count=5, batch_size=8, max_new_tokens=40,
                                       min_chars=3, exclude=set(prompts), max_samples=64)
    assert not set(excluded) & set(prompts)


def test_framed_code_chunks_always_leave_room_for_training(tmp_path):
    from angelspec_hf.training.corpus import framed_code_sequences
    from angelspec_hf.training.data import MIN_TRAINED_TOKENS

    (tmp_path / "empty.py").write_text("")
    (tmp_path / "tiny.py").write_text("w7 w8 w9\n")
    (tmp_path / "big.py").write_text(" ".join(f"w{3 + i % 90}" for i in range(3000)))
    tokenizer = tiny_tokenizer()
    rows = framed_code_sequences(tokenizer, seq_len=1200, max_tokens=100_000, root=str(tmp_path))
    assert rows and all(len(row["input_ids"]) - row["loss_start"] >= MIN_TRAINED_TOKENS for row in rows)
    assert all(len(row["input_ids"]) <= 1200 for row in rows)
    assert sum(len(row["input_ids"]) - row["loss_start"] for row in rows) > 2900  # the big file, nearly whole


def test_the_rollouts_command_grows_magpie_prompts_and_caches_states_for_each_recipe(targets, tmp_path, monkeypatch):
    from angelspec_hf import cli
    from angelspec_hf.training.features import FeatureCache
    from angelspec_hf.training.recipes import Recipe, new_drafter

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    monkeypatch.setattr(cli, "load_target", lambda name, dtype="float32": (target, tokenizer))
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{9 + i} w{40 + i} w{70 - i}"}) + "\n" for i in range(8)))
    out = tmp_path / "rollouts" / "tiny-chat"
    command = ["rollouts", "--prompts", str(prompts), "--output-dir", str(out), "--max-new-tokens", "8",
               "--batch-size", "4", "--feature-cache", str(tmp_path / "cache"), "--recipe", "mtp-chat", "dfly-code"]
    assert cli.main(command + ["--magpie", "3"]) == 0
    assert cli.main(command + ["--magpie", "5"]) == 0
    listed = [json.loads(line)["prompt"] for line in (tmp_path / "rollouts" / "prompts" / "tiny-chat-magpie.jsonl").open()]
    answered = [json.loads(line) for line in (out / "magpie-train.jsonl").open()]
    assert len(listed) == 5 and sorted(row["prompt"] for row in answered) == sorted(listed)
    assert len([line for line in (out / "mine-train.jsonl").open()]) == 6  # the training split of 8
    for recipe in ("mtp-chat", "dfly-code"):
        cache = FeatureCache(tmp_path / "cache", target, new_drafter(target, Recipe(name=recipe)).config.target_layer_ids)
        for path in out.glob("*.jsonl"):
            for line in path.open():
                assert cache.load(torch.tensor(record_row(json.loads(line), 448)["input_ids"])) is not None


def test_the_rollouts_command_decodes_in_the_dtype_asked_and_refuses_a_cache_training_would_never_read(
        targets, tmp_path, monkeypatch):
    from angelspec_hf import cli

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    asked = []

    def load(name, dtype="float32"):
        asked.append(dtype)
        return target.to(getattr(torch, dtype)), tokenizer

    monkeypatch.setattr(cli, "load_target", load)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{9 + i} w{40 + i}"}) + "\n" for i in range(8)))
    out = tmp_path / "rollouts"
    command = ["rollouts", "--prompts", str(prompts), "--output-dir", str(out), "--max-new-tokens", "6", "--batch-size", "4"]
    try:
        assert cli.main(command + ["--dtype", "bfloat16"]) == 0
    finally:
        target.float()
    assert asked == ["bfloat16"]
    rows = [json.loads(line) for line in (out / "mine-train.jsonl").open()]
    assert len(rows) == 6 and all(row["response_ids"] for row in rows)
    with pytest.raises(SystemExit, match="--feature-cache"):
        cli.main(command + ["--dtype", "bfloat16", "--feature-cache", str(tmp_path / "cache")])
    assert asked == ["bfloat16"]  # refused before loading anything


def test_an_opening_steers_magpie_prompts_and_the_rows_keep_the_domain_asked(targets, tmp_path, monkeypatch):
    from angelspec_hf import cli
    from angelspec_hf.training.data import synthesize_chat_prompts

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    prompts = synthesize_chat_prompts(target, tokenizer, count=4, batch_size=8, max_new_tokens=40, min_chars=3,
                                      opening="w5 w6")
    assert len(set(prompts)) == 4 and all(p.startswith("w5 w6 ") and len(p) > len("w5 w6 ") for p in prompts)
    plain = synthesize_chat_prompts(target, tokenizer, count=4, batch_size=8, max_new_tokens=40, min_chars=3)
    assert not all(p.startswith("w5 w6") for p in plain)

    monkeypatch.setattr(cli, "load_target", lambda name, dtype="float32": (target, tokenizer))
    out = tmp_path / "rollouts" / "tiny-code"
    assert cli.main(["rollouts", "--prompts", "--output-dir", str(out), "--max-new-tokens", "6", "--batch-size", "4",
                     "--magpie", "3", "--magpie-opening", "w5 w6", "--magpie-domain", "code"]) == 0
    rows = [json.loads(line) for line in (out / "magpie-train.jsonl").open()]
    listed = [json.loads(line) for line in (tmp_path / "rollouts" / "prompts" / "tiny-code-magpie.jsonl").open()]
    assert len(rows) == 3 and {row["domain"] for row in rows} == {"code"} == {row["domain"] for row in listed}
    assert all(row["prompt"].startswith("w5 w6 ") for row in rows)


def test_the_longest_magpie_turn_is_an_option(targets, tmp_path, monkeypatch):
    from angelspec_hf import cli
    from angelspec_hf.training import data

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    monkeypatch.setattr(cli, "load_target", lambda name, dtype="float32": (target, tokenizer))
    asked = []
    synthesize = data.synthesize_chat_prompts
    monkeypatch.setattr(data, "synthesize_chat_prompts",
                        lambda *a, **kw: asked.append(kw["max_new_tokens"]) or synthesize(*a, **kw))
    out = tmp_path / "rollouts" / "tiny-chat"
    command = ["rollouts", "--prompts", "--output-dir", str(out), "--max-new-tokens", "4", "--batch-size", "4",
               "--magpie", "2"]
    assert cli.main(command) == 0 and cli.main(command + ["--magpie", "4", "--magpie-turn-tokens", "30"]) == 0
    assert asked == [64, 30]


def test_draft_vocab_narrows_a_reduced_vocabulary_to_its_own_most_frequent_tokens(targets, tmp_path, monkeypatch):
    from transformers import AutoModel

    from angelspec_hf import cli
    from angelspec_hf.modeling_angelspec_dfly import DFlyDrafter

    target = targets.target("llama")
    DFlyDrafter.from_target(target, draft_token_ids=list(range(10, 60))).save_pretrained(tmp_path / "drafter")
    # Token 5 is the most frequent response token but outside the drafter's 50 tokens.
    response = [5] * 50 + [40] * 30 + [30] * 20 + [20] * 10 + [11] * 5 + [12] * 2
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "r.jsonl").write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": response}) + "\n")
    monkeypatch.setattr(cli, "load_target", lambda name, dtype="float32": (target, tiny_tokenizer()))

    def draft_vocab(size):
        assert cli.main(["draft-vocab", str(tmp_path / "drafter"), "--data", str(tmp_path / "rollouts"),
                         "--corpus-tokens", "0", "--size", str(size)]) == 0
        return AutoModel.from_pretrained(tmp_path / "drafter").draft_vocab.tolist()

    assert draft_vocab(4) == [11, 20, 30, 40]  # narrowed within its own tokens
    assert 5 in draft_vocab(8)  # widened: counted afresh over the target vocabulary


def test_token_counts_count_the_trained_positions_of_every_row_and_refuse_ids_outside_the_vocabulary():
    """The draft vocabulary of a new drafter is counted on the response tokens (from ``loss_start``) only."""
    from angelspec_hf.training.recipes import token_counts

    rows = [{"input_ids": [5, 1, 2, 2], "loss_start": 2}, {"input_ids": [3, 3, 9], "loss_start": 1},
            {"input_ids": [7], "loss_start": 1}]
    counts = token_counts(rows, 10)
    expected = torch.zeros(10, dtype=torch.long)
    expected[2], expected[3], expected[9] = 2, 1, 1
    assert torch.equal(counts, expected)
    with pytest.raises(ValueError, match="outside the target's vocabulary of 9"):
        token_counts(rows, 9)


def test_rollouts_read_as_a_datasets_dataset_with_a_loss_mask_over_the_responses(targets, tmp_path):
    from datasets import load_from_disk

    from angelspec_hf.training.data import rollouts_dataset

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    prompts = [" ".join(f"w{(11 * i + j) % 90 + 6}" for j in range(2 + i % 3)) for i in range(3)]
    generate_rollouts(target, tokenizer, prompts, tmp_path / "rollouts" / "a.jsonl", max_new_tokens=7, domain="code")
    records = [json.loads(line) for line in (tmp_path / "rollouts" / "a.jsonl").read_text().splitlines()]
    dataset = rollouts_dataset([tmp_path / "rollouts"])
    assert dataset.column_names == ["prompt", "domain", "input_ids", "loss_mask"] and len(dataset) == 3
    for row, record in zip(dataset, records):
        assert row["input_ids"] == record["prompt_ids"] + record["response_ids"] and row["domain"] == "code"
        assert row["loss_mask"] == [0] * len(record["prompt_ids"]) + [1] * len(record["response_ids"])
    dataset.save_to_disk(tmp_path / "saved")
    assert load_from_disk(tmp_path / "saved")[:] == dataset[:]
    with pytest.raises(FileNotFoundError, match="missing"):
        rollouts_dataset([tmp_path / "missing"])
