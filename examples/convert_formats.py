"""Move drafters between angelspec-hf and the formats serving engines load.

    python examples/convert_formats.py path/to/drafter out/

Writes, depending on the drafter:
- DFlash-mode block drafter: the z-lab DFlash format (vLLM, SGLang) and transformers' own DFlash
  assistant (``target.generate(..., speculation_type="dflash")``);
- DFly (hybrid conditioning) or DFlare drafter: AngelSpec's Qwen3DFlyModel / DFlare format;
- MTP drafter: EAGLE-3 (LlamaForCausalLMEagle3; a full-vocabulary one needs the target for its lm_head),
  or, with the DeepSeek-style layer (recipe mtp-chat-deepseek), AngelSpec's MTPDraftModel.
and reads each export back. The shell equivalent is `angelspec-hf convert --to FORMAT SRC DST`.
"""

import sys
from pathlib import Path

from transformers import AutoModel

from angelspec_hf.interop import (
    export_angelspec,
    export_angelspec_mtp,
    export_dflash,
    export_eagle3,
    export_transformers_dflash,
    load_angelspec,
    load_angelspec_mtp,
    load_dflash,
    load_eagle3,
)
from angelspec_hf.reference import load_reference_target

source, out = sys.argv[1], Path(sys.argv[2])
drafter = AutoModel.from_pretrained(source)
if drafter.config.model_type == "angelspec_mtp" and drafter.config.layer_style == "deepseek":
    target, _ = load_reference_target()
    export_angelspec_mtp(drafter, out / "angelspec-mtp", target=target)
    print("AngelSpec MTPDraftModel:", out / "angelspec-mtp", "reads back as",
          type(load_angelspec_mtp(out / "angelspec-mtp", target=target)).__name__)
elif drafter.config.model_type == "angelspec_mtp":
    target, _ = load_reference_target()
    export_eagle3(drafter, out / "eagle3", target=target)
    print("EAGLE-3:", out / "eagle3", "reads back as", type(load_eagle3(out / "eagle3", target=target)).__name__)
elif drafter.config.variant == "dflash":
    export_dflash(drafter, out / "dflash")
    export_transformers_dflash(drafter, out / "transformers-dflash")
    print("z-lab DFlash:", out / "dflash", "reads back as", type(load_dflash(out / "dflash")).__name__)
    print("transformers DFlash assistant:", type(AutoModel.from_pretrained(out / "transformers-dflash")).__name__)
else:
    export_angelspec(drafter, out / "angelspec")
    print("AngelSpec:", out / "angelspec", "reads back as", type(load_angelspec(out / "angelspec")).__name__)
