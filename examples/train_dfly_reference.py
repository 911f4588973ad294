"""The runs that trained the shipped DFly drafter (and its DFlash baseline) for the reference target.

    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly 450 100 400000
    git worktree add /tmp/first f706b30      # the first shipped pair (450 steps each)
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly2 1100 100 600000 \\
        --from /tmp/first/modeling/SmolLM2-135M-Instruct-AngelSpec-DFly-Block8 --lr 5e-4 --code-seed 1 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly3 1500 0 600000 \\
        --from modeling-runs/dfly2/lk --lr 5e-4 --code-seed 1 --seed 2 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly4 3000 0 600000 \\
        --from modeling-runs/dfly3/lk --lr 5e-4 --code-seed 1 --seed 3 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly5 3000 0 600000 \\
        --from modeling-runs/dfly4/lk --lr 5e-4 --code-seed 1 --seed 4 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache --bf16 \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct --rollouts data/rollouts/SmolLM2-135M-Instruct-code
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly6 3000 0 600000 \\
        --from modeling-runs/dfly5/lk --lr 5e-4 --code-seed 1 --seed 5 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache --bf16 \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct --rollouts data/rollouts/SmolLM2-135M-Instruct-code
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly7 3000 0 100000 \\
        --from modeling/SmolLM2-135M-Instruct-AngelSpec-DFly-Block8 --lr 5e-4 --code-seed 1 --seed 6 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache --bf16 \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct --rollouts data/rollouts/SmolLM2-135M-Instruct-code \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct-math
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly9 3000 0 100000 \\
        --from modeling/SmolLM2-135M-Instruct-AngelSpec-DFly-Block8 --lr 5e-4 --code-seed 1 --seed 8 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache --bf16 \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct --rollouts data/rollouts/SmolLM2-135M-Instruct-code \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct-math
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly10 3000 0 100000 \\
        --from modeling-runs/dfly9/lk --lr 5e-4 --code-seed 1 --seed 9 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache --bf16 \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct --rollouts data/rollouts/SmolLM2-135M-Instruct-code \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct-math
    python examples/train_dfly_reference.py dflash-code modeling-runs/dflash11 3000 0 100000 \\
        --from modeling/SmolLM2-135M-Instruct-AngelSpec-DFlash-Block8 --lr 5e-4 --code-seed 1 --seed 10 \\
        --corpus data/corpus/SmolLM2-135M-Instruct --cache feature-cache --bf16 \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct --rollouts data/rollouts/SmolLM2-135M-Instruct-code \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct-math
    python examples/train_dfly_reference.py dfly-code modeling-runs/dfly12 3000 0 0 \\
        --from modeling/SmolLM2-135M-Instruct-AngelSpec-DFly-Block8 --lr 5e-4 --code-seed 1 --seed 11 \\
        --cache feature-cache --rollouts data/rollouts/SmolLM2-135M-Instruct \\
        --rollouts data/rollouts/SmolLM2-135M-Instruct-code --rollouts data/rollouts/SmolLM2-135M-Instruct-math \\
        --rollout-length 1024

The first command trained the first shipped DFly drafter (over the full vocabulary; its 8192-token
draft vocabulary was set afterwards with `angelspec-hf draft-vocab`); the second continued it
(its LK checkpoint `modeling-runs/dfly2/lk`; 88 minutes beside the DFlash run; the 100 TV steps
after it were worse); the third continued that on the same data in a new row order
(`modeling-runs/dfly3/lk`, 72 minutes beside the DFlash run), the fourth did so again
(`modeling-runs/dfly4/lk`, 75 minutes beside the DFlash run), the fifth added the steered Magpie code
rollouts in mixed precision (31 minutes; their target states were put into the feature cache first
with `angelspec_hf.training.corpus.fill_feature_cache`, 5.5 minutes at two threads, so that the two
runs did not both compute them) and the sixth made a
second pass over that data (`modeling-runs/dfly6/lk`, 36 minutes); the seventh added the steered
Magpie math rollouts and cut the code corpus to 100k tokens, so that a fresh machine fills the
feature cache for every row in about 20 minutes (one `fill_feature_cache` process per core), and
continued the bfloat16 weights shipped before it (commit 294d445) into the shipped one
(`modeling-runs/dfly7/lk`, 24 minutes); the eighth, after the 600 code and 450 math rollouts of
2026-12-01/02 (data/README.md) had joined the three folders, continued the shipped (4096-token)
drafter over them (`modeling-runs/dfly8` was a grown 4-layer run that was not shipped; 34 minutes)
and the ninth made a second pass in a new row order into the shipped one (`modeling-runs/dfly10/lk`,
33 minutes). The last command (2026-12-03, after 450 more steered math rollouts joined the math
folder) continued the shipped DFlash baseline into the one shipped now (39 minutes); the same
command with `dfly-code` and the DFly drafter (`modeling-runs/dfly11`) did not improve held-out tau
and was not shipped (README, "Trained drafters"). The last (2026-12-04, after the MATH-500 and
LiveCodeBench training-split rollouts joined the code and math folders) trained both shipped drafters,
DFly and (with ``dflash-code``, ``modeling-runs/dflash12``) DFlash, on the rollouts alone (no corpus,
``corpus_tokens`` 0) cut at 1024 tokens (55 / 50 minutes side by side, after
``--fill-cache 0/2`` and ``1/2`` with the same arguments filled the feature cache in 33 minutes).
Those two were continued on one GPU with 1.41M tokens of new rollouts into the ones shipped now:
`examples/gpu_rollouts_and_train.py` (its docstring has the commands).

Stage 1 (LK + D-PACE) runs on standard-library code framed as replies to the training split of
the code prompts (``corpus_tokens`` of it, files in ``--code-seed`` order), the target's code and
math rollouts (twice) and, with ``--corpus DIR``, the math rows of `angelspec-hf corpus`. Stage 2
(end-to-end TV) reloads the rollouts (they may still be growing from `angelspec-hf rollouts` on
the other core) and mixes in half as many code chunks. `dflash-code` with the same arguments (and
``--from`` the DFlash drafter) gives the DFlash baseline. ``--from DIR`` continues a trained
drafter: one with a draft vocabulary then trains over that vocabulary only, which makes a step
about 4x cheaper on this CPU (the loss's passes over 49k logits were 70% of it). ``--lr`` sets the
LK learning rate (TV: a third), ``--seed`` the order of rows and anchors, ``--cache DIR`` keeps the
target's states per row on disk, ``--rollouts DIR`` (repeatable) reads the rollouts of these folders
instead of ``data/rollouts/SmolLM2-135M-Instruct`` (for example with the code and math Magpie rollouts
as well, see data/README.md). ``--bf16`` trains in mixed precision (the drafter's matmuls in
bfloat16; soft labels and weights float32), 1.4x (DFly) to 1.6x (MTP) faster steps on this AMX CPU.
``--weight-decay W`` sets AdamW's decoupled weight decay (default 0). ``--rollout-length N`` cuts
rollout rows (prompt + response) at N tokens (default 448); rows whose prompt alone is longer train
nothing, so the LiveCodeBench rollouts (prompts of 752 tokens at the median) need about 1024.
``--fill-cache I/N`` (with ``--cache DIR`` and the run's other arguments) only computes the target's
states of part I of N of the rows the run reads and exits: on a fresh machine run ``0/2`` and ``1/2``
side by side first (one per core; 2026-12-04: about 250 tokens/s each on an AVX2-only EPYC, about an
hour with the math corpus and 100k tokens of code; 321-325 on an avx512_bf16 EPYC, 33 minutes for the
three rollout folders alone at 1024 tokens), since two training runs
side by side otherwise both compute the same missing states, at 6-10 s a step instead of about 1.
``--resume`` continues stage 1 from its last Trainer checkpoint (``out/checkpoints-lk``) after an
interruption; pass the same ``--from``/``--grow`` so that the model has the checkpoint's shape.
One torch thread, so that a second run can use the other core.
"""

import sys
import time
from pathlib import Path

import torch
import angelspec_hf  # noqa: F401
from _flags import option, options
from angelspec_hf.reference import load_reference_target
from angelspec_hf.training.corpus import framed_code_sequences
from angelspec_hf.training.data import rollout_sequences
from angelspec_hf.training.recipes import Recipe, continued_drafter, train_drafter


torch.set_num_threads(1)
name, out, lk_steps, tv_steps, corpus_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
target, tokenizer = load_reference_target()
start = time.time()
corpus = framed_code_sequences(tokenizer, seq_len=320, max_tokens=corpus_tokens, seed=int(option("--code-seed", 0)))
math_rows = rollout_sequences([Path(option("--corpus")) / "math-corpus.jsonl"], seq_len=448) if option("--corpus") else []
rollout_dirs = [Path(d) for d in options("--rollouts")] or [Path("data/rollouts/SmolLM2-135M-Instruct")]


def read_rollouts() -> list[dict]:
    return rollout_sequences(sorted(f for d in rollout_dirs for f in d.glob("*.jsonl")),
                             seq_len=int(option("--rollout-length", 448)))


rollouts = read_rollouts()
print("stage 1 data:", len(corpus), "code chunks,", len(math_rows), "math corpus rows,", len(rollouts), "rollouts", flush=True)
if option("--fill-cache"):
    from angelspec_hf.cli import recipe_feature_caches
    from angelspec_hf.training.corpus import fill_feature_cache

    if not option("--cache"):
        raise SystemExit("--fill-cache fills the feature cache: give it with --cache DIR")
    part, parts = (int(n) for n in option("--fill-cache").split("/"))
    cache = recipe_feature_caches(target, option("--cache"), [name])[name]
    rows = sorted(corpus + math_rows + rollouts, key=lambda row: len(row["input_ids"]))[part::parts]
    print(fill_feature_cache(target, cache, rows), flush=True)
    raise SystemExit(0)
recipe = Recipe(name=name, lk_steps=lk_steps, tv_steps=0, batch_size=4, num_anchors=24, logging_steps=10,
                learning_rate=float(option("--lr", 1e-3)), feature_cache=option("--cache"),
                seed=int(option("--seed", 0)), bf16="--bf16" in sys.argv,
                weight_decay=float(option("--weight-decay", 0.0)))
grow = int(option("--grow")) if option("--grow") else None
drafter = continued_drafter(option("--from"), recipe, grow) if option("--from") else None
drafter = train_drafter(target, corpus + math_rows + rollouts * 2, out, recipe, pad_token_id=tokenizer.eos_token_id,
                        drafter=drafter, resume="--resume" in sys.argv)
rollouts = read_rollouts()
print("stage 2 data:", len(rollouts), "rollouts", flush=True)
recipe.lk_steps, recipe.tv_steps = 0, tv_steps
train_drafter(target, rollouts + corpus[: len(rollouts) // 2], out, recipe, pad_token_id=tokenizer.eos_token_id,
              drafter=drafter.train())
print(f"done in {time.time() - start:.0f} s", flush=True)
