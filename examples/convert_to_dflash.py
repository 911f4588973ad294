"""Export a DFlash-mode drafter to the z-lab DFlash format (served by vLLM and SGLang) and back.

    python examples/convert_to_dflash.py path/to/dflash-drafter out/zlab-format
"""

import sys

from transformers import AutoModel

from angelspec_hf.interop import export_dflash, load_dflash

source, destination = sys.argv[1], sys.argv[2]
export_dflash(AutoModel.from_pretrained(source), destination)
print("written", destination, "- reads back as", type(load_dflash(destination)).__name__)
