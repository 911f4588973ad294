"""Distillation data from existing text: the cheap, large source for the cold-start stage.

Reading text with the target costs one forward per 300-odd tokens, generating it one forward per
token, so on a CPU a corpus gives about 10x the tokens of rollouts for the same time. Text is
framed as the assistant's reply to a training prompt of its domain, so the target's hidden states
look like the deployed ones:

- ``code``: Python source of the standard library (and, with ``root``, any other tree), as a
  reply to a HumanEval/MBPP training prompt inside a code fence;
- ``math``: generated multi-step word problems with worked solutions (arithmetic written out
  line by line, the way the reference target answers), as the reply to the problem itself;
- ``chat``: the prose of installed packages' documentation (their long descriptions), as replies
  to MT-Bench training prompts; and the training prompts themselves read as user turns;
- files: any text files, as replies to MT-Bench training prompts (code fences for ``.py``).

Rows use the rollout schema (``prompt``, ``domain``, ``prompt_ids``, ``response_ids``) plus
``origin``, so ``angelspec-hf train --data`` reads rollouts and corpora alike. The soft labels
(the target's next-token distributions) are not stored as top-k lists: `FeatureCache` keeps the
target's final hidden state per row, whose ``lm_head`` is the exact distribution.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import random
import sysconfig
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm.auto import tqdm

from ..prompts import load_prompts
from .data import MIN_TRAINED_TOKENS, chat_prefix_ids, record_row, user_turn_prefix_ids
from .trainer import SequenceCollator

SOURCES = ("code", "math", "chat")
CODE_FENCE = "```python\n"


def framed_rows(tokenizer, documents: Iterable[tuple[str, str, str]], seq_len: int, max_tokens: int, domain: str,
                origin: str) -> list[dict]:
    """``(prompt, reply prefix, text)`` documents as rows: chat prefix of the prompt plus the reply
    prefix, then the text in chunks that fill ``seq_len``; every chunk trains at least
    ``MIN_TRAINED_TOKENS`` tokens."""
    rows, total = [], 0
    for prompt, reply_prefix, text in documents:
        if total >= max_tokens:
            break
        prefix = chat_prefix_ids(tokenizer, prompt) + tokenizer.encode(reply_prefix, add_special_tokens=False)
        body = seq_len - len(prefix)
        if body < MIN_TRAINED_TOKENS:
            continue
        tokens = tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, len(tokens), body):
            chunk = tokens[start : start + body]
            if len(chunk) < MIN_TRAINED_TOKENS or total >= max_tokens:
                break
            rows.append({"prompt": prompt, "domain": domain, "origin": origin, "prompt_ids": prefix, "response_ids": chunk})
            total += len(chunk)
    return rows


def python_source_files(root: str | None = None, max_bytes: int = 200_000) -> list[Path]:
    """The Python standard library's own source: plenty of real code that every machine has."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(base.rglob("*.py")) if "site-packages" not in p.parts and p.stat().st_size <= max_bytes]
    return files


def code_documents(rng: random.Random, root: str | None = None) -> Iterator[tuple[str, str, str]]:
    """Source files in a seeded order, each framed by a random code training prompt (read lazily)."""
    prompts = load_prompts("humaneval", "train") + load_prompts("mbpp", "train")
    files = python_source_files(root)
    rng.shuffle(files)
    return ((rng.choice(prompts), CODE_FENCE, path.read_text(errors="ignore")) for path in files)


def framed_code_sequences(tokenizer, seq_len: int, max_tokens: int, seed: int = 0, root: str | None = None) -> list[dict]:
    """Standard-library code as training rows (``input_ids``, ``loss_start``, ``domain``)."""
    return [record_row(row, seq_len) for row in corpus_rows(tokenizer, "code", max_tokens, seq_len, seed, root)]


# --------------------------------------------------------------------------- math

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira", "Liam", "Maya", "Noah")
ITEMS = ("apples", "pencils", "stickers", "books", "cookies", "marbles", "cards", "flowers", "coins", "shells")


def _problem_shopping(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per_pack, price, extra = rng.randint(2, 9), rng.randint(3, 12), rng.randint(2, 15), rng.randint(1, 20)
    total_items = packs * per_pack
    cost = packs * price
    paid = cost + extra
    question = (f"{name} buys {packs} packs of {item}. Each pack has {per_pack} {item} and costs ${price}. "
                f"{name} pays with ${paid}. How many {item} does {name} get, and how much change does {name} receive?")
    answer = (f"To solve this problem, we need to find the number of {item} and the change.\n\n"
              f"Each pack has {per_pack} {item}, so {packs} packs have {packs} * {per_pack} = {total_items} {item}.\n"
              f"Each pack costs ${price}, so {packs} packs cost {packs} * ${price} = ${cost}.\n"
              f"{name} pays ${paid}, so the change is ${paid} - ${cost} = ${extra}.\n\n"
              f"So, {name} gets {total_items} {item} and receives ${extra} in change.\n#### {extra}")
    return question, answer


def _problem_rate(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    speed, hours, rest_speed, rest_hours = rng.randint(3, 60), rng.randint(2, 8), rng.randint(2, 30), rng.randint(1, 5)
    first, second = speed * hours, rest_speed * rest_hours
    question = (f"{name} travels at {speed} miles per hour for {hours} hours, then at {rest_speed} miles per hour "
                f"for {rest_hours} hours. How many miles does {name} travel in total?")
    answer = (f"First, {name} travels {speed} miles per hour for {hours} hours.\n"
              f"{speed} * {hours} = {first} miles.\n"
              f"Then {name} travels {rest_speed} miles per hour for {rest_hours} hours.\n"
              f"{rest_speed} * {rest_hours} = {second} miles.\n"
              f"In total, {name} travels {first} + {second} = {first + second} miles.\n#### {first + second}")
    return question, answer


def _problem_share(rng: random.Random) -> tuple[str, str]:
    name, friend, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, kept = rng.randint(2, 8), rng.randint(2, 15), rng.randint(1, 30)
    given = friends * each
    start = given + kept
    question = (f"{name} has {start} {item}. {name} gives {each} {item} to each of {friends} friends, including {friend}. "
                f"How many {item} does {name} have left?")
    answer = (f"{name} gives {each} {item} to each of {friends} friends.\n"
              f"So {name} gives away {each} * {friends} = {given} {item}.\n"
              f"{name} started with {start} {item}, so {name} has {start} - {given} = {kept} {item} left.\n\n"
              f"The answer is {kept}.\n#### {kept}")
    return question, answer


def _problem_percent(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    price = rng.randint(2, 40) * 10
    percent = rng.choice((10, 20, 25, 30, 40, 50))
    discount = price * percent // 100
    question = (f"A jacket costs ${price}. It is on sale for {percent}% off. {name} also pays $5 for shipping. "
                f"How much does {name} pay in total?")
    answer = (f"The discount is {percent}% of ${price}.\n"
              f"{percent}/100 * {price} = ${discount}.\n"
              f"The sale price is ${price} - ${discount} = ${price - discount}.\n"
              f"With shipping, {name} pays ${price - discount} + $5 = ${price - discount + 5}.\n#### {price - discount + 5}")
    return question, answer


def _problem_ages(rng: random.Random) -> tuple[str, str]:
    name, other = rng.sample(NAMES, 2)
    age, times, years = rng.randint(3, 20), rng.randint(2, 4), rng.randint(2, 10)
    older = age * times
    question = (f"{name} is {age} years old. {other} is {times} times as old as {name}. "
                f"How old will {other} be in {years} years?")
    answer = (f"{other} is {times} times as old as {name}, so {other} is {times} * {age} = {older} years old.\n"
              f"In {years} years, {other} will be {older} + {years} = {older + years} years old.\n\n"
              f"So, {other} will be {older + years} years old.\n#### {older + years}")
    return question, answer


def _problem_weekly(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    weekday, weekend, weeks = rng.randint(1, 12), rng.randint(2, 20), rng.randint(2, 6)
    per_week = 5 * weekday + 2 * weekend
    question = (f"{name} collects {weekday} {item} every weekday and {weekend} {item} on each day of the weekend. "
                f"How many {item} does {name} collect in {weeks} weeks?")
    answer = (f"On weekdays, {name} collects 5 * {weekday} = {5 * weekday} {item}.\n"
              f"On the weekend, {name} collects 2 * {weekend} = {2 * weekend} {item}.\n"
              f"In one week, {name} collects {5 * weekday} + {2 * weekend} = {per_week} {item}.\n"
              f"In {weeks} weeks, {name} collects {weeks} * {per_week} = {weeks * per_week} {item}.\n#### {weeks * per_week}")
    return question, answer


MATH_TEMPLATES = (_problem_shopping, _problem_rate, _problem_share, _problem_percent, _problem_ages, _problem_weekly)


def math_documents(rng: random.Random, count: int | None = None, end_of_turn: str = "") -> Iterator[tuple[str, str, str]]:
    """Generated word problems with their worked solutions, as (problem, "", solution + end of turn);
    endless without ``count``."""
    for _ in range(count) if count is not None else itertools.count():
        question, answer = rng.choice(MATH_TEMPLATES)(rng)
        yield question, "", answer + end_of_turn


# --------------------------------------------------------------------------- chat

def package_documentation(min_chars: int = 2000) -> list[str]:
    """Long descriptions (README prose, mostly Markdown) of the installed Python distributions."""
    texts = {}
    for dist in importlib.metadata.distributions():
        payload = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if len(payload) >= min_chars:
            texts[dist.metadata.get("Name", "")] = payload
    return [texts[name] for name in sorted(texts)]


def chat_documents(rng: random.Random) -> list[tuple[str, str, str]]:
    prompts = load_prompts("mtbench", "train")
    documents = [(rng.choice(prompts), "", text) for text in package_documentation()]
    rng.shuffle(documents)
    return documents


def prompt_reading_rows(tokenizer, prompts: list[str], origin: str) -> list[dict]:
    """Prompts read as user turns: the loss covers the prompt text (what the target expects a user to write)."""
    header = user_turn_prefix_ids(tokenizer)
    rows = []
    for prompt in prompts:
        full = chat_prefix_ids(tokenizer, prompt)
        if full[: len(header)] == header and len(full) - len(header) >= MIN_TRAINED_TOKENS:
            rows.append({"prompt": prompt, "domain": "chat", "origin": origin, "prompt_ids": header,
                         "response_ids": full[len(header):]})
    return rows


def file_documents(paths: list[Path], rng: random.Random) -> Iterator[tuple[str, str, str]]:
    """Text files framed by random chat training prompts, read lazily (only until the token budget is met)."""
    prompts = load_prompts("mtbench", "train")
    return ((rng.choice(prompts), CODE_FENCE if path.suffix == ".py" else "", path.read_text(errors="ignore"))
            for path in paths)


def corpus_rows(tokenizer, source: str, max_tokens: int, seq_len: int = 320, seed: int = 0,
                root: str | None = None, extra_prompts: list[str] | None = None) -> list[dict]:
    """Rows of one source: ``code``, ``math``, ``chat``, or a text file / directory of them."""
    rng = random.Random(seed)
    if source == "code":
        return framed_rows(tokenizer, code_documents(rng, root), seq_len, max_tokens, "code", "corpus:code")
    if source == "math":
        documents = math_documents(rng, end_of_turn=tokenizer.eos_token or "")
        return framed_rows(tokenizer, documents, seq_len, max_tokens, "math", "corpus:math")
    if source == "chat":
        reading = prompt_reading_rows(tokenizer, load_prompts("mtbench", "train") + list(extra_prompts or []),
                                      "corpus:chat-prompts")
        budget = max_tokens - sum(len(r["response_ids"]) for r in reading)
        return reading + framed_rows(tokenizer, chat_documents(rng), seq_len, max(budget, 0), "chat", "corpus:chat-docs")
    path = Path(source)
    if not path.exists():
        raise ValueError(f"corpus source must be one of {SOURCES} or an existing file or directory, got {source!r}.")
    paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return framed_rows(tokenizer, file_documents(paths, rng), seq_len, max_tokens, "chat", f"corpus:{path.name}")


def write_rows(rows: list[dict], out_file: Path) -> Path:
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out_file


def fill_feature_cache(target, cache, rows: list[dict], batch_size: int = 8) -> dict[str, float]:
    """Run the target once over ``rows`` (as training reads them) and keep their states in ``cache``.

    Rows are bucketed by length to limit padding. Returns tokens read and tokens per second.
    """
    order = sorted(rows, key=lambda row: len(row["input_ids"]))
    collate = SequenceCollator(pad_token_id=0)  # padding is masked out and never stored
    tokens, start = 0, time.perf_counter()
    with tqdm(total=sum(len(r["input_ids"]) for r in order), desc="target states", unit="tok", unit_scale=True) as bar:
        for first in range(0, len(order), batch_size):
            batch = collate(order[first : first + batch_size])
            cache.states(target, batch["input_ids"], batch["attention_mask"], batch["lengths"], target.dtype)
            batch_tokens = int(batch["lengths"].sum())
            tokens += batch_tokens
            bar.update(batch_tokens)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0}
