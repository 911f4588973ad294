"""Bundled prompt sets and their fixed train/eval split."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

PROMPT_SETS = {"mtbench": "chat", "humaneval": "code", "mbpp": "code", "gsm8k": "math"}
DOMAINS = {"chat": ("mtbench",), "code": ("humaneval", "mbpp"), "math": ("gsm8k",)}
EVAL_EVERY = 4


def _read_jsonl(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def load_prompts(name: str, split: str = "eval", limit: int | None = None) -> list[str]:
    """Prompts of a bundled set (``mtbench``, ``humaneval``, ``mbpp``, ``gsm8k``) or of a JSONL file.

    ``split="eval"`` keeps rows whose index is a multiple of 4 (held out from training),
    ``"train"`` the others, ``"all"`` every row.
    """
    if name in PROMPT_SETS:
        rows = _read_jsonl(Path(str(resources.files("angelspec_hf") / "data" / "prompts" / f"{name}.jsonl")))
    else:
        rows = _read_jsonl(Path(name))
    if split not in ("eval", "train", "all"):
        raise ValueError(f"split must be 'eval', 'train' or 'all', got {split!r}.")
    if split != "all":
        rows = [row for index, row in enumerate(rows) if (index % EVAL_EVERY == 0) == (split == "eval")]
    return rows[:limit] if limit is not None else rows


def domain_prompts(domain: str, split: str = "eval", per_set: int | None = None) -> list[str]:
    """Prompts of every bundled set of a domain (``chat``, ``code``, ``math``)."""
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {sorted(DOMAINS)}, got {domain!r}.")
    return [prompt for name in DOMAINS[domain] for prompt in load_prompts(name, split, per_set)]
