"""The runs that trained the shipped MTP drafter for the reference target (2 CPU cores).

    python examples/train_mtp_reference.py mtp-chat modeling-runs/mtp 500 120
    python examples/train_mtp_reference.py mtp-chat modeling-runs/mtp2 500 120 --from modeling-runs/mtp/final \\
        --corpus data/corpus/SmolLM2-135M-Instruct --lr 4e-4 --cache feature-cache
    python examples/train_mtp_reference.py mtp-chat modeling-runs/mtp3 400 150 --from modeling-runs/mtp/final \\
        --lr 4e-4 --chat-repeat 2 --cache feature-cache     # after more Magpie chat rollouts
    python examples/train_mtp_reference.py mtp-chat modeling-runs/mtp7 400 150 \\
        --from modeling/SmolLM2-135M-Instruct-AngelSpec-MTP-TTT3 --lr 4e-4 --chat-repeat 2 --cache feature-cache \\
        --bf16 --seed 7 --chat-rollouts data/rollouts/SmolLM2-135M-Instruct-chat \\
        --chat-rollouts data/rollouts/SmolLM2-135M-Instruct-chat-steered

The shipped drafter's last run (session 51, after session 39's GPU LK stage and 150 CPU TV steps,
docs/trained-drafters.md): 600 more TV steps, then saved in bfloat16:

    python examples/train_mtp_reference.py mtp-chat modeling-runs/s51-tv-hi 0 600 \\
        --from modeling/SmolLM2-135M-Instruct-AngelSpec-MTP-TTT3 --lr 1.2e-3 --chat-repeat 1 --bf16 --seed 52 \\
        --threads 1 --chat-rollouts data/rollouts/SmolLM2-135M-Instruct-chat \\
        --chat-rollouts data/rollouts/SmolLM2-135M-Instruct-chat-steered

The first command trained the MTP drafter shipped until 2026-12-01 (`modeling-runs/mtp/final`); the
second and third continued it without a held-out gain (see README); the last continued it (the
weights of commit 294d445) with the steered chat rollouts added into the shipped one (31 minutes,
held-out MT-Bench chat tau 1.349 -> 1.387). Not shipped (README, "Trained drafters"): the same
continuation with the 1400 steered rollouts of 2026-12-03 (`modeling-runs/mtp8 700 100 ... --seed 8
--threads 1`, chat tau 1.391) and that run grown to two layers (`modeling-runs/mtp9 ... --grow 2`, 1.378).
Nor, on 2026-12-03 (session 31, float32 on an AVX2-only CPU), the shipped drafter rewired to DFly's
five target layers (`modeling-runs/mtp10 350 60 --from ... --lr 4e-4 --seed 8 --cache feature-cache
--threads 1 --chat-repeat 2 --target-layers 1,8,14,20,27 --chat-rollouts ... --chat-rollouts ...`, 1.384)
against the same run on three (`modeling-runs/mtp12 ... --target-layers 1,14,27`, 1.387).

Both stages read every rollout in the repository: the chat rollouts (Magpie-style and MT-Bench
training prompts) three times, the code and math rollouts once, so that the drafter sees the
target's chat style most but still learns its general next-token behaviour from 5x more tokens
than the chat rollouts alone hold. Draft vocabulary: the 8192 most frequent response tokens
(one lm_head row in six, which is what makes drafting cheap on a CPU); TTT depth 3.
`mtp-chat-nottt` with the same arguments gives the teacher-forcing ablation, `mtp-chat-deepseek`
AngelSpec's MTPDraftModel layer. Options: `--from DIR` continues a trained drafter, `--corpus DIR`
adds `angelspec-hf corpus` rows to the LK stage (the TV stage stays on rollouts), `--lr` sets the
LK learning rate (TV: a third of it), `--cache DIR` keeps the target's states per row on disk,
`--seed N` sets the order of rows, `--grow N` (with `--from`) first stacks plain decoder layers on
the drafter up to N, each starting as the identity (`grow_mtp_layers`). `--bf16` trains in mixed precision (the drafter's matmuls in bfloat16; soft labels
and weights float32), 1.4x (DFly) to 1.6x (MTP) faster steps on this AMX CPU.
`--target-layers 1,8,14,20,27` reads those target layers instead of the default three; with `--from`
the drafter's fusion is rewired to them first (`rewire_mtp_target_layers`). `--weight-decay W` sets
AdamW's decoupled weight decay (default 0).
`--chat-repeat N` (default 3) repeats the chat rollouts N times in both stages. `--chat-rollouts DIR`
(repeatable) reads the chat rollouts of these folders instead of `data/rollouts/SmolLM2-135M-Instruct-chat`
(for example with steered Magpie chat rollouts as well, see data/README.md). The TV stage re-reads
the rollouts when it starts, so rollouts generated during the LK stage (for example by
`angelspec-hf rollouts --magpie` on the other core) join it. One torch thread, so that a second
run or a benchmark can use the other core; `--threads N` gives the run N threads instead (a machine
with nothing else to do).
"""

import sys
import time
from pathlib import Path

import torch

import angelspec_hf  # noqa: F401
from _flags import option, options
from angelspec_hf.cli import layer_list
from angelspec_hf.reference import load_reference_target
from angelspec_hf.training.data import rollout_sequences
from angelspec_hf.training.recipes import Recipe, continued_drafter, train_drafter


torch.set_num_threads(int(option("--threads", 1)))
name, out, lk_steps, tv_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
target, tokenizer = load_reference_target()
start = time.time()


chat_dirs = [Path(d) for d in options("--chat-rollouts")] or [Path("data/rollouts/SmolLM2-135M-Instruct-chat")]


def read_rollouts() -> list[dict]:
    chat = rollout_sequences(sorted(f for d in chat_dirs for f in d.glob("*.jsonl")), seq_len=448)
    other = rollout_sequences(sorted(Path("data/rollouts/SmolLM2-135M-Instruct").glob("*.jsonl")), seq_len=448)
    print("rollouts:", len(chat), "chat,", len(other), "code/math", flush=True)
    return chat * int(option("--chat-repeat", 3)) + other


rollouts = read_rollouts()
corpus = rollout_sequences(sorted(Path(option("--corpus")).glob("*.jsonl")), seq_len=448) if option("--corpus") else []
print("corpus rows:", len(corpus), flush=True)
recipe = Recipe(name=name, num_draft_tokens=3, draft_vocab_size=8192, lk_steps=lk_steps, tv_steps=0,
                batch_size=4, logging_steps=10, learning_rate=float(option("--lr", 1e-3)), feature_cache=option("--cache"),
                seed=int(option("--seed", 0)), bf16="--bf16" in sys.argv,
                weight_decay=float(option("--weight-decay", 0.0)),
                target_layer_ids=layer_list(option("--target-layers")) if option("--target-layers") else None)
grow = int(option("--grow")) if option("--grow") else None
drafter = continued_drafter(option("--from"), recipe, grow) if option("--from") else None
resume = "--resume" in sys.argv
drafter = train_drafter(target, rollouts + corpus, out, recipe, pad_token_id=tokenizer.eos_token_id, resume=resume,
                        drafter=drafter)
# The TV stage re-reads the rollouts: ones generated while the LK stage ran join the finish.
recipe.lk_steps, recipe.tv_steps = 0, tv_steps
train_drafter(target, read_rollouts(), out, recipe, pad_token_id=tokenizer.eos_token_id, resume=resume,
              drafter=drafter.train())
print(f"done in {time.time() - start:.0f} s", flush=True)
