"""Push a drafter to the Hub with a generated model card, then find drafters for its target.

    HF_TOKEN=... python examples/share_on_hub.py path/to/drafter your-name/SmolLM2-135M-Instruct-AngelSpec-DFly-Block8

Loading it back is plain transformers: AutoModel.from_pretrained(repo_id) (or with
trust_remote_code=True where angelspec-hf is not installed).
"""

import sys

from angelspec_hf.hub import find_drafters, push_drafter
from angelspec_hf.reference import REFERENCE_TARGET_ID

directory, repo_id = sys.argv[1], sys.argv[2]
print(push_drafter(directory, repo_id, private=True))
for entry in find_drafters(REFERENCE_TARGET_ID):
    print(entry["repo_id"], entry["best_tau"])
