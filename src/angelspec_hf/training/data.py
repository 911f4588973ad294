"""Training data for drafters: target rollouts on prompts, and the rows both rollouts and
corpora (`corpus`) become.

Drafters learn the target, not a corpus: rollouts are the target's own greedy responses (chat
template applied). Only token ids are stored (4 bytes a token); features and soft labels are
recomputed from the target (or kept in a `FeatureCache`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from datasets import Dataset
from tqdm.auto import tqdm


logger = logging.getLogger(__name__)


def chat_prefix_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a user turn plus the assistant header, as generation sees them."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


# --------------------------------------------------------------------------- rollouts


def generate_rollouts(
    target, tokenizer, prompts: list[str], out_file: Path, max_new_tokens: int = 192, batch_size: int = 16,
    domain: str = "", feature_caches: list = (), seq_len: int = 448,
) -> dict[str, float]:
    """Greedy target responses, appended to a JSONL file of token ids; resumable.

    Rows already in ``out_file`` (matched by prompt) are skipped, so an interrupted run continues
    where it stopped without duplicates. Decoding runs through `SpeculativeEngine` without a
    drafter: continuous batching, so a finished row leaves the batch at once and the next prompt
    takes its place (padded ``generate`` keeps decoding every row until the longest one ends).
    Prompts are sorted by length; each row is written (and the progress bar advances) as soon as
    its request finishes, so an interruption loses only the rows still decoding. Returns new
    tokens, seconds and tokens per second.

    ``feature_caches`` (`FeatureCache` objects) receive the target's states of each row as
    training will read it (`record_row` with ``seq_len``), captured while decoding: no second
    pass over the rollouts.
    """
    from ..generation.engine import SpeculativeEngine

    out_file.parent.mkdir(parents=True, exist_ok=True)
    done = {record["prompt"] for record in read_records(out_file, repair=True)} if out_file.exists() else set()
    prefix_of = {p: chat_prefix_ids(tokenizer, p) for p in dict.fromkeys(prompts) if p not in done}
    todo = sorted(prefix_of, key=lambda p: len(prefix_of[p]))
    prefixes = [prefix_of[p] for p in todo]
    engine = SpeculativeEngine(target, None, max_batch_size=batch_size)
    capture = sorted({i for cache in feature_caches for i in cache.layer_ids}) if feature_caches else None
    responses: dict[int, list[int]] = {}
    new_tokens, start = 0, time.perf_counter()
    with open(out_file, "a") as sink, tqdm(total=len(todo), desc=f"rollouts {out_file.name}", unit="prompt") as bar:
        for event in engine.stream(prefixes, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                   capture_layers=capture):
            responses.setdefault(event.request, []).extend(event.tokens)
            if not event.finished:
                continue
            bar.update(1)
            response = responses.pop(event.request)
            states = engine.captured_states.pop(event.request, None)
            if event.error is not None:
                logger.warning("Skipping a prompt the target cannot continue: %s", event.error)
                continue
            response = strip_after_eos(response, tokenizer.eos_token_id)
            new_tokens += len(response)
            record = {"prompt": todo[event.request], "domain": domain, "prompt_ids": prefixes[event.request],
                      "response_ids": response}
            if capture is not None:
                _store_captured(feature_caches, capture, states, record_row(record, seq_len))
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            bar.set_postfix(tokens_per_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
    seconds = time.perf_counter() - start
    return {"new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": new_tokens / seconds if seconds else 0.0}


def _store_captured(caches: list, captured_layers: list[int], states: tuple[torch.Tensor, torch.Tensor], row: dict) -> None:
    """Store one row's captured states in every cache, each with the layers it keeps."""
    features, final = states
    length = len(row["input_ids"])
    token_ids = torch.tensor(row["input_ids"])
    for cache in caches:
        picks = [captured_layers.index(i) for i in cache.layer_ids]
        cache.store(token_ids, features[picks, :length], final[:length])


def strip_after_eos(row: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in row:
        return row[: row.index(eos) + 1]
    return row


def read_records(path: Path, repair: bool = False) -> list[dict]:
    """The JSON rows of a JSONL file of rollouts, corpus rows or prompts.

    Rows are written whole with their newline last, so a file that does not end in a newline was cut
    inside its last row (a run killed while writing it): that row is left out with a warning, and with
    ``repair`` cut from the file, so that rows appended next start on a line of their own (appended
    after the fragment, the first of them would be lost with it and the file unreadable). A broken row
    anywhere else is an error naming its line.
    """
    path = Path(path)
    raw = path.read_bytes()
    whole = raw.rfind(b"\n") + 1
    if whole < len(raw):
        logger.warning("%s ends inside a row (%d bytes after the last newline, a run stopped while writing it): "
                       "%s.", path, len(raw) - whole,
                       "cut from the file; its prompt is generated again" if repair else "that row is left out")
        if repair:
            with open(path, "r+b") as handle:
                handle.truncate(whole)
    records = []
    for number, line in enumerate(raw[:whole].split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {number}, is not a JSON row ({error}): fix or delete that line.") from None
    return records


def rollout_sequences(files: list[Path], seq_len: int) -> list[dict]:
    """Rollout rows as training sequences: prompt + response, loss from the response start.

    Rows with fewer than ``MIN_TRAINED_TOKENS`` response tokens within ``seq_len`` are left out,
    and how many is logged: short responses, or prompts that fill most of ``seq_len``."""
    rows, short = [], 0
    for path in files:
        for record in read_records(path):
            if "response_ids" not in record:
                raise ValueError(f"{path} holds rows without response_ids: it is not a rollout or corpus file.")
            row = record_row(record, seq_len)
            if len(row["input_ids"]) - row["loss_start"] >= MIN_TRAINED_TOKENS:
                rows.append(row)
            else:
                short += 1
    if short:
        logger.warning("Left out %d of %d rows with fewer than %d response tokens within the first %d tokens "
                       "(longer rollouts: rollouts --max-new-tokens; room after long prompts: --rollout-length).",
                       short, short + len(rows), MIN_TRAINED_TOKENS, seq_len)
    return rows


def record_row(record: dict, seq_len: int | None) -> dict:
    """A stored rollout/corpus record as a training row: prompt + response, loss from the response start."""
    return {"input_ids": (record["prompt_ids"] + record["response_ids"])[:seq_len], "loss_start": len(record["prompt_ids"]),
            "domain": record.get("domain", "")}


# --------------------------------------------------------------------------- synthetic chat prompts

_SENTINEL = "\u2063angelspec-user-turn\u2063"


def user_turn_prefix_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (the empty user header)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise ValueError("the tokenizer's chat template does not show the user's message verbatim")
    return tokenizer.encode(text[: text.index(_SENTINEL)], add_special_tokens=False)


def synthesize_chat_prompts(
    target, tokenizer, count: int, batch_size: int = 16, max_new_tokens: int = 64, seed: int = 0,
    min_chars: int = 12, existing: list[str] = (), exclude: set[str] = frozenset(), max_samples: int | None = None,
    opening: str = "",
) -> list[str]:
    """Magpie-style prompts: the target samples a user turn from its own empty user header.

    ``opening`` starts every user turn with that text (for example "Write a Python function that")
    and the target writes the rest, which steers the prompts to a domain (code, math) while the
    request itself stays the target's own; each prompt is the opening plus what was sampled.

    Returns ``existing`` followed by new prompts until there are ``count``, so a list grows from
    run to run (the sampling seed moves with the list's length, so a resumed run draws new turns).
    Sampling runs through `SpeculativeEngine` (continuous batching): a short turn leaves the
    batch at its EOS instead of waiting for the longest one. Duplicates, turns in ``exclude``
    (evaluation prompts), near-empty turns and turns cut off by the length limit are dropped;
    at most ``max_samples`` (default ``4 * count``) turns are drawn.
    """
    from ..generation.engine import SpeculativeEngine

    opening_ids = tokenizer.encode(opening, add_special_tokens=False) if opening else []
    prefix = user_turn_prefix_ids(tokenizer) + opening_ids
    eos = tokenizer.eos_token_id
    prompts: dict[str, None] = dict.fromkeys(existing)
    allowed = max_samples if max_samples is not None else 4 * count
    budget = allowed
    engine = SpeculativeEngine(target, None, max_batch_size=batch_size)
    torch.manual_seed(seed + len(prompts))
    with tqdm(total=count, initial=min(len(prompts), count), desc="synthesising Magpie prompts", unit="prompt") as bar:
        while len(prompts) < count and budget > 0:
            draws = min(4 * batch_size, budget)
            budget -= draws
            outputs = engine.generate([prefix] * draws, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                      do_sample=True, temperature=1.0, top_p=0.95)
            for output in outputs:
                turn = output[len(prefix):]
                if eos not in turn:
                    continue  # cut off: not a complete user turn
                # Decoded with the opening, so the tokenizer places the space between them as it would in one text.
                text = tokenizer.decode(opening_ids + turn[: turn.index(eos)], skip_special_tokens=True).strip()
                if len(text) >= min_chars and text not in prompts and text not in exclude and len(prompts) < count:
                    prompts[text] = None
                    bar.update(1)
    if len(prompts) < count:
        logger.warning("Synthesised %d of %d Magpie prompts within %d samples (too many duplicates or cut-off turns).",
                       len(prompts), count, allowed)
    return list(prompts)


MIN_TRAINED_TOKENS = 32


def sequences_dataset(rows: list[dict]) -> Dataset:
    return Dataset.from_list(rows)


def jsonl_files(paths: list[str | Path]) -> list[Path]:
    """The JSONL files named, and those inside the directories named, in a stable order."""
    files = []
    for name in paths:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"{name}: no such file or directory")
        files += sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    return files


def rollouts_dataset(paths: list[str | Path]) -> Dataset:
    """Rollout (or corpus) files as a `datasets.Dataset`: per row the prompt, its domain, the token ids
    (prompt then response) and a loss mask over the response tokens, uncut; ``save_to_disk`` keeps it.

    Why the files are JSONL rather than a saved Dataset: `generate_rollouts` appends each row as its
    request finishes, so an interrupted run keeps every finished row and resumes without duplicates,
    and the token ids accumulate in git from run to run as plain, diffable lines; an Arrow dataset
    is rewritten whole. ``paths``: files, or directories of ``*.jsonl`` files.
    """
    rows = []
    for file in jsonl_files(paths):
        for record in read_records(file):
            row = record_row(record, seq_len=None)
            trained = len(row["input_ids"]) - row["loss_start"]
            rows.append({"prompt": record.get("prompt", ""), "domain": row["domain"], "input_ids": row["input_ids"],
                         "loss_mask": [0] * row["loss_start"] + [1] * trained})
    return Dataset.from_list(rows)
