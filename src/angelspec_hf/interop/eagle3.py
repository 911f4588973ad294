"""The EAGLE-3 format (``LlamaForCausalLMEagle3``, as trained by SpecForge and served by vLLM and SGLang).

An MTP drafter is an EAGLE-3 layer: ``fc`` fuses three target layers, the one decoder layer
attends over ``[input_norm(embedding); hidden_norm(hidden)]``, then ``norm`` and a reduced-vocabulary
``lm_head`` with the same ``d2t``/``t2d`` maps (target id = draft id + ``d2t[draft id]``). Only the
names differ (``midlayer.*``, ``input_layernorm``, ``post_attention_layernorm``). The format has
no record of which target layers feed ``fc`` nor of the target's depth: EAGLE-3 always reads
decoder layers ``1, L // 2 - 1, L - 4``, which is our default, so importing needs the target
(or its layer count); SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` is honoured.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..configuration_angelspec_mtp import MTPDrafterConfig
from ..errors import DrafterCheckpointError, DrafterConfigError
from ..modeling_angelspec_mtp import MTPDrafter
from .checkpoint import (
    load_weights,
    naming_config,
    one_layer_fields,
    read_config,
    read_tensors,
    required,
    write_checkpoint,
)

# Our weight name -> EAGLE-3 name.
NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "post_attention_norm.weight": "midlayer.post_attention_layernorm.weight",
    **{f"self_attn.{name}.weight": f"midlayer.self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"mlp.{name}.weight": f"midlayer.mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")},
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}
# Present in some checkpoints, never needed: drafters use the target's embeddings.
IGNORED = ("embed_tokens.weight",)


def eagle3_config_dict(config: MTPDrafterConfig) -> dict:
    draft_vocab_size = config.draft_vocab_size if config.uses_reduced_vocab else config.vocab_size
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.target_layer_ids)},
        "angelspec_target": {"name_or_path": config.target_name_or_path, "num_layers": config.num_target_layers,
                             "embedding_fingerprint": config.target_embedding_fingerprint},
        # Serving engines take the draft depth from their command line; this keeps ours on a round trip.
        "angelspec_draft": {"num_draft_tokens": config.num_draft_tokens, "ttt_steps": config.ttt_steps},
    }


def export_eagle3(drafter: MTPDrafter, out_dir: str | Path, target=None) -> Path:
    """Write an MTP drafter as an EAGLE-3 checkpoint (config + safetensors).

    EAGLE-3 always has its own ``lm_head``: a full-vocabulary drafter (which borrows the target's)
    needs ``target`` to copy it from, with identity ``d2t``/``t2d``.
    """
    config = drafter.config
    if config.model_type != "angelspec_mtp":
        raise DrafterConfigError(
            f"Only MTP drafters map to the EAGLE-3 format, this is {config.model_type!r}. Fix: convert a DFlash-mode "
            "block drafter with --to dflash instead."
        )
    if config.layer_style != "eagle3":
        raise DrafterConfigError(
            f"This MTP drafter has a {config.layer_style}-style layer, which EAGLE-3 cannot hold. "
            "Fix: export it with --to angelspec (AngelSpec's MTPDraftModel)."
        )
    if config.target_layer_ids is None or len(config.target_layer_ids) != 3:
        raise DrafterConfigError(f"EAGLE-3 fuses exactly 3 target layers; this drafter reads {config.target_layer_ids}.")
    if config.num_hidden_layers != 1:
        raise DrafterConfigError(
            f"EAGLE-3 checkpoints hold one decoder layer; this MTP drafter has {config.num_hidden_layers}. Fix: share it "
            "in the angelspec-hf format (save_pretrained / push_to_hub), which transformers loads as remote code."
        )
    if config.qk_norm:
        raise DrafterConfigError(
            "EAGLE-3 layers have no QK-norm; this MTP drafter normalises its queries and keys (qk_norm=True), so no "
            "EAGLE-3 checkpoint computes what it does. Fix: share it in the angelspec-hf format (save_pretrained / "
            "push_to_hub), or train one with qk_norm=False to export to EAGLE-3."
        )
    weights = {key: value.detach() for key, value in drafter.state_dict().items()}
    if not config.uses_reduced_vocab:
        if target is None:
            raise DrafterConfigError(
                "This MTP drafter drafts through the target's lm_head, which EAGLE-3 stores in the drafter. "
                "Fix: pass the target (angelspec-hf convert --target ...)."
            )
        drafter.check_target(target)
        weights["lm_head.weight"] = target.get_output_embeddings().weight.detach().to(drafter.dtype)
        weights["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    return write_checkpoint(out_dir, {NAMES[key]: value for key, value in weights.items()}, eagle3_config_dict(config))


def eagle3_drafter_config(raw: dict, target=None, num_target_layers: int | None = None) -> MTPDrafterConfig:
    """Our config for an EAGLE-3 config dict; the target (or its layer count) fills what the format lacks."""
    fields = one_layer_fields(raw, "EAGLE-3", target, num_target_layers)
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vocab_size, hidden_size = required(raw, "vocab_size"), required(raw, "hidden_size")
    draft_vocab_size = raw.get("draft_vocab_size") or vocab_size
    if raw.get("target_hidden_size", hidden_size) != hidden_size:
        raise DrafterConfigError(
            f"This EAGLE-3 drafter is {hidden_size} wide for a {raw['target_hidden_size']}-wide target; "
            "angelspec-hf MTP drafters share the target's width."
        )
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise DrafterCheckpointError(f"EAGLE-3 drafters have one decoder layer, this config has {raw['num_hidden_layers']}.")
    fields.update(
        target_layer_ids=list(aux) if aux else None,
        draft_vocab_size=draft_vocab_size if draft_vocab_size < vocab_size else None,
        **(raw.get("angelspec_draft") or {}),
    )
    return MTPDrafterConfig(**fields)


def load_eagle3(path: str | Path, target=None, num_target_layers: int | None = None, dtype: torch.dtype | None = None) -> MTPDrafter:
    """An EAGLE-3 checkpoint directory as an `MTPDrafter` (strict: every tensor mapped), in ``dtype`` or
    the file's own.

    A draft vocabulary as large as the target's is read as a full-vocabulary drafter, whose
    ``lm_head`` must then equal the target's (it is borrowed from the target, not stored), so
    such a file with an ``lm_head`` needs ``target`` to be compared with.
    """
    with naming_config(path):
        config = eagle3_drafter_config(read_config(path), target, num_target_layers)
    theirs = read_tensors(path, IGNORED)
    inverse = {v: k for k, v in NAMES.items()}
    if not config.uses_reduced_vocab:
        for name in ("lm_head.weight", "d2t", "t2d"):
            inverse.pop(name)
        head = theirs.pop("lm_head.weight", None)
        for name in ("d2t", "t2d"):  # identity maps of a full-vocabulary head
            theirs.pop(name, None)
        if head is not None:
            check_borrowed_head(head, target, path)
    drafter = load_weights(MTPDrafter(config), theirs, inverse, f"{path} is not an EAGLE-3 checkpoint", path, dtype)
    if target is not None:
        drafter.check_target(target)  # the file's own sizes (vocabulary, width) against the target's
    return drafter


def check_borrowed_head(head: torch.Tensor, target, path: str | Path) -> None:
    """A full-vocabulary drafter drafts through the target's ``lm_head``; a stored head is read only
    if it is the target's, since dropping another one would draft with a head it was not trained with."""
    if target is None:
        raise DrafterConfigError(
            f"{path} drafts over the whole vocabulary with its own {tuple(head.shape)} lm_head; angelspec-hf "
            "drafts through the target's lm_head instead, and can tell that the two are the same only with the "
            "target. Fix: pass target=... (angelspec-hf convert --target ...)."
        )
    own = target.get_output_embeddings().weight.detach().cpu()
    # Compared in the file's dtype: a bfloat16 export holds the float32 target's head rounded.
    if head.shape != own.shape or not torch.equal(head, own.to(head.dtype)):
        raise DrafterCheckpointError(
            f"{path} drafts over the whole vocabulary with its own lm_head, which differs from the target's; "
            "angelspec-hf borrows the target's head for full-vocabulary drafters. Fix: use a reduced draft vocabulary."
        )
