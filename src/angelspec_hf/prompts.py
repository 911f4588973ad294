"""Bundled prompt sets and their fixed train/eval split."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

PROMPT_SETS = {"mtbench": "chat", "humaneval": "code", "mbpp": "code", "gsm8k": "math"}
DOMAINS = {"chat": ("mtbench",), "code": ("humaneval", "mbpp"), "math": ("gsm8k",)}
EVAL_EVERY = 4


def _read_jsonl(path: Path) -> list[str]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}, line {number}: expected a JSON object with a \"prompt\" string, "
                             'one a line (for example {"prompt": "Write a haiku about tea."}).')
        prompts.append(row["prompt"])
    return prompts


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
    """Prompts of every bundled set of a domain (``chat``, ``code``, ``math``; ``per_set`` of each),
    or of a JSONL prompt file (its first ``per_set`` rows; ``split`` does not apply: a file of
    one's own prompts has no held-out split)."""
    if domain in DOMAINS:
        return [prompt for name in DOMAINS[domain] for prompt in load_prompts(name, split, per_set)]
    return load_prompts(prompt_file(domain), "all", per_set)


def held_out_prompts(domain: str, per_set: int | None = None) -> list[str]:
    """Prompts a drafter was not trained on: the held-out split of every bundled set of a domain
    (``per_set`` of each), or of a JSONL prompt file the rows `angelspec-hf rollouts --prompts FILE`
    leaves out (every ``EVAL_EVERY``-th, from the first; its first ``per_set`` of them)."""
    if domain in DOMAINS:
        return domain_prompts(domain, "eval", per_set)
    return load_prompts(prompt_file(domain), "eval", per_set)


def prompt_file(domain: str) -> str:
    """A domain that is not a bundled one, checked to be a JSONL prompt file."""
    path = Path(domain)
    if path.suffix != ".jsonl" or not path.is_file():
        raise ValueError(f"domain must be one of {sorted(DOMAINS)} or a JSONL prompt file "
                         f'(one {{"prompt": ...}} a line), got {domain!r}.')
    return str(path)


def domain_label(domain: str) -> str:
    """How reports name a domain: itself, or a prompt file's name without its suffix."""
    return domain if domain in DOMAINS else Path(domain).stem


def domain_sets(domain: str) -> int:
    """How many prompt sets a domain draws ``per_set`` prompts from (a prompt file is one)."""
    return len(DOMAINS[domain]) if domain in DOMAINS else 1
