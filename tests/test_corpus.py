"""Distillation rows from existing text: framing, worked math, chat sources, the command."""

import json
import random
import re

import pytest
import torch

from angelspec_hf.training.corpus import (
    MATH_TEMPLATES,
    corpus_rows,
    fill_feature_cache,
    math_documents,
    package_documentation,
)
from angelspec_hf.training.data import MIN_TRAINED_TOKENS, chat_prefix_ids, rollout_sequences, user_turn_prefix_ids
from angelspec_hf.training.features import FeatureCache
from fitting import tiny_tokenizer

EQUATION = re.compile(r"\$?(\d+)(?:/100)? ([*+-]) \$?(\d+) = \$?(\d+)")


def test_worked_math_is_correct_arithmetic():
    rng = random.Random(3)
    documents = list(math_documents(rng, 300, end_of_turn="</s>"))
    assert {template.__name__ for template in MATH_TEMPLATES} and len(documents) == 300
    for question, reply_prefix, solution in documents:
        assert question.endswith("?") and reply_prefix == "" and solution.endswith("</s>")
        equations = EQUATION.findall(solution)
        assert equations, solution
        for left, op, right, result in equations:
            if "/100" in solution and op == "*" and f"{left}/100 * {right}" in solution:
                assert int(left) * int(right) // 100 == int(result)
            else:
                assert {"*": int(left) * int(right), "+": int(left) + int(right), "-": int(left) - int(right)}[op] == int(result)
        final = int(solution.split("#### ")[1].removesuffix("</s>"))
        assert final == int(equations[-1][3]) or f"receives ${final}" in solution


def test_rows_are_framed_replies_in_the_rollout_schema(tmp_path):
    tokenizer = tiny_tokenizer()
    (tmp_path / "notes.txt").write_text(" ".join(f"w{3 + i % 90}" for i in range(400)))
    rows = corpus_rows(tokenizer, str(tmp_path), max_tokens=10_000, seq_len=120)
    assert rows and all(row["origin"] == f"corpus:{tmp_path.name}" for row in rows)
    for row in rows:
        assert row["prompt_ids"] == chat_prefix_ids(tokenizer, row["prompt"])  # an MT-Bench training prompt's turn
        assert MIN_TRAINED_TOKENS <= len(row["response_ids"]) and len(row["prompt_ids"]) + len(row["response_ids"]) <= 120
    assert sum(len(row["response_ids"]) for row in rows) >= 350
    math = corpus_rows(tokenizer, "math", max_tokens=3000)
    assert sum(len(row["response_ids"]) for row in math) >= 3000 and {row["domain"] for row in math} == {"math"}
    with pytest.raises(ValueError, match="corpus source must be one of"):
        corpus_rows(tokenizer, str(tmp_path / "missing"), max_tokens=10)


def test_chat_reads_prompts_as_user_turns_and_documentation_as_replies():
    tokenizer = tiny_tokenizer()
    long_prompt = " ".join(f"w{6 + i % 80}" for i in range(40))
    rows = corpus_rows(tokenizer, "chat", max_tokens=5000, extra_prompts=[long_prompt])
    reading = [row for row in rows if row["origin"] == "corpus:chat-prompts"]
    assert any(row["prompt"] == long_prompt for row in reading)
    for row in reading:
        assert row["prompt_ids"] == user_turn_prefix_ids(tokenizer)
        assert row["prompt_ids"] + row["response_ids"] == chat_prefix_ids(tokenizer, row["prompt"])
    if package_documentation():
        assert any(row["origin"] == "corpus:chat-docs" for row in rows)


def test_the_command_writes_rows_and_fills_the_feature_cache(targets, tmp_path, monkeypatch):
    from angelspec_hf import cli

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    monkeypatch.setattr(cli, "load_target", lambda name, dtype="float32": (target, tokenizer))
    (tmp_path / "text.txt").write_text(" ".join(f"w{3 + i % 90}" for i in range(600)))
    out = tmp_path / "corpus"
    assert cli.main(["corpus", "--source", "math", str(tmp_path / "text.txt"), "--tokens", "400", "--seq-len", "100",
                     "--output-dir", str(out), "--feature-cache", str(tmp_path / "cache"), "--recipe", "mtp-chat"]) == 0
    files = sorted(out.glob("*.jsonl"))
    assert [f.name for f in files] == ["math-corpus.jsonl", "text-corpus.jsonl"]
    assert all("response_ids" in json.loads(line) for f in files for line in f.read_text().splitlines())
    rows = rollout_sequences(files, seq_len=448)
    from angelspec_hf.training.recipes import Recipe, new_drafter

    cache = FeatureCache(tmp_path / "cache", target, new_drafter(target, Recipe(name="mtp-chat")).config.target_layer_ids)
    assert all(cache.load(torch.tensor(row["input_ids"])) is not None for row in rows)
    assert fill_feature_cache(target, cache, rows)["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert cache.misses == 0


def test_data_arguments_take_files_and_directories(tmp_path):
    from angelspec_hf.cli import jsonl_files

    (tmp_path / "rollouts").mkdir()
    for name in ("b.jsonl", "a.jsonl", "notes.txt"):
        (tmp_path / "rollouts" / name).write_text("")
    (tmp_path / "extra.jsonl").write_text("")
    files = jsonl_files([str(tmp_path / "rollouts"), str(tmp_path / "extra.jsonl")])
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl", "extra.jsonl"]
    with pytest.raises(SystemExit, match="no such file or directory"):
        jsonl_files([str(tmp_path / "missing")])
