"""Benchmark one drafter against plain generate on the reference target, in this process.

    python examples/benchmark.py modeling/SmolLM2-135M-Instruct-AngelSpec-MTP-TTT3 [chat code math]

Prints tau, tokens/s and speedup per domain (2 held-out prompts each, 96 new tokens, greedy,
interleaved with plain generate and transformers' prompt lookup), and whether every output equals
plain generate. The full main job, with every shipped drafter, D-cut and the engine, is
`angelspec-hf bench` (`make bench`).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts: busy-waiting threads distort timings

import sys  # noqa: E402

from transformers import AutoModel  # noqa: E402

import angelspec_hf  # noqa: E402,F401  (registers the drafters and the generate integration)
from angelspec_hf.benchmark import format_table, run_benchmark, summarise  # noqa: E402
from angelspec_hf.reference import load_reference_target  # noqa: E402

path, domains = sys.argv[1], sys.argv[2:] or ["chat", "code", "math"]
target, tokenizer = load_reference_target()
drafter = AutoModel.from_pretrained(path, dtype=target.dtype).eval()  # saved in bfloat16; draft in the target's dtype
runs = run_benchmark(target, tokenizer, {os.path.basename(path.rstrip("/")): drafter}, domains, per_set=2, max_new_tokens=96)
print(format_table(summarise(runs)))
