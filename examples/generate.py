"""Generate with a drafter on the reference target and check the output equals plain generate.

    python examples/generate.py [path/to/drafter]

Without a path an untrained DFly drafter is built (exact, but not faster: it is never accepted).
"""

import sys

import torch
from transformers import AutoModel

import angelspec_hf  # noqa: F401  (registers the drafters and the generate integration)
from angelspec_hf import DFlyDrafter
from angelspec_hf.reference import load_reference_target

target, tokenizer = load_reference_target()
drafter = AutoModel.from_pretrained(sys.argv[1], dtype=target.dtype) if len(sys.argv) > 1 else DFlyDrafter.from_target(target, block_size=8)
messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

with torch.no_grad():
    plain = target.generate(**inputs, max_new_tokens=96, do_sample=False)
    fast = target.generate(**inputs, assistant_model=drafter.eval(), max_new_tokens=96, do_sample=False)

print(tokenizer.decode(fast[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print("identical to plain generate:", torch.equal(plain, fast))
print("statistics:", drafter.last_speculation_stats.as_dict())
