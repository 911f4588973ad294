"""Serve several prompts at once with the batched engine: plain, speculative, and speculative with
D-cut across requests (which drafts only while it pays on this hardware).

    python examples/serve_batch.py [path/to/drafter]
"""

import sys
import time

import torch
from transformers import AutoModel

from angelspec_hf import SpeculativeEngine
from angelspec_hf.generation import BatchDCutPolicy, load_or_profile
from angelspec_hf.prompts import domain_prompts
from angelspec_hf.reference import REFERENCE_TARGET_ID, load_reference_target
from angelspec_hf.training.data import chat_prefix_ids

target, tokenizer = load_reference_target()
drafter = AutoModel.from_pretrained(sys.argv[1], dtype=target.dtype).eval() if len(sys.argv) > 1 else None
prompts = domain_prompts("code", "eval", per_set=4)
ids = [chat_prefix_ids(tokenizer, prompt) for prompt in prompts]

configurations = [("plain batched", None, None)]
if drafter is not None:
    cost_model = load_or_profile(target, REFERENCE_TARGET_ID)  # measured once per machine, then cached
    configurations += [("speculative", drafter, None), ("speculative + D-cut", drafter, BatchDCutPolicy(cost_model))]
for name, model, policy in configurations:
    engine = SpeculativeEngine(target, model, max_batch_size=8, policy=policy)
    start = time.perf_counter()
    with torch.no_grad():
        outputs = engine.generate(ids, max_new_tokens=96, eos_token_id=tokenizer.eos_token_id)
    new = sum(len(out) - len(prompt) for out, prompt in zip(outputs, ids))
    print(f"{name}: {new / (time.perf_counter() - start):.1f} tokens/s over {len(ids)} requests")
print(tokenizer.decode(outputs[0][len(ids[0]):], skip_special_tokens=True))

# The same engine streaming: a request submitted while the others decode, its tokens printed as
# they are committed.
engine = SpeculativeEngine(target, drafter, max_batch_size=8)
for prompt in ids[1:]:
    engine.submit(prompt, max_new_tokens=96, eos_token_id=tokenizer.eos_token_id)
for _ in range(3):
    engine.step()
live = engine.submit(ids[0], max_new_tokens=96, eos_token_id=tokenizer.eos_token_id)
while engine.has_work:
    for event in engine.step():
        if event.request == live:
            print(tokenizer.decode(event.tokens, skip_special_tokens=True), end="", flush=True)
print()
