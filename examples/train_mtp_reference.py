"""The run that trained the shipped MTP drafter for the reference target (2 CPU cores).

    python examples/train_mtp_reference.py mtp-chat modeling-runs/mtp 600 150

Both stages read every rollout in the repository: the chat rollouts (Magpie-style and MT-Bench
training prompts) three times, the code and math rollouts once, so that the drafter sees the
target's chat style most but still learns its general next-token behaviour from 5x more tokens
than the chat rollouts alone hold. Draft vocabulary: the 8192 most frequent response tokens
(one lm_head row in six, which is what makes drafting cheap on a CPU); TTT depth 3.
`mtp-chat-nottt` with the same arguments gives the teacher-forcing ablation.
One torch thread, so that a second run or a benchmark can use the other core.
"""

import sys
import time
from pathlib import Path

import torch

import angelspec_hf  # noqa: F401
from angelspec_hf.reference import load_reference_target
from angelspec_hf.training.data import rollout_sequences
from angelspec_hf.training.recipes import Recipe, train_drafter

torch.set_num_threads(1)
name, out, lk_steps, tv_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
resume = "--resume" in sys.argv
target, tokenizer = load_reference_target()
start = time.time()
chat = rollout_sequences(sorted(Path("data/rollouts/SmolLM2-135M-Instruct-chat").glob("*.jsonl")), seq_len=448)
other = rollout_sequences(sorted(Path("data/rollouts/SmolLM2-135M-Instruct").glob("*.jsonl")), seq_len=448)
print("data:", len(chat), "chat rollouts,", len(other), "code/math rollouts", flush=True)
recipe = Recipe(name=name, num_draft_tokens=3, draft_vocab_size=8192, lk_steps=lk_steps, tv_steps=tv_steps,
                batch_size=4, logging_steps=10)
train_drafter(target, chat * 3 + other, out, recipe, pad_token_id=tokenizer.eos_token_id, resume=resume)
print(f"done in {time.time() - start:.0f} s", flush=True)
