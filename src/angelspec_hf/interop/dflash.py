"""The z-lab DFlash format (``DFlashDraftModel``, as served by vLLM and SGLang).

Only the DFlash special case of DFly maps onto it (``conditioning="global"``, no correction
head): the format has no place for DFly's per-layer mix or its correction head. Its config is a
Qwen3 config with ``block_size`` and a ``dflash_config`` holding ``mask_token_id`` and
``target_layer_ids`` (older checkpoints keep them top-level; both are read). Its weights are ours
under other names.

AngelSpec's own ``DFlashDraftModel`` shares the architecture name but not the layout (its
``num_target_layers`` counts the fused layers, the target's depth is ``target_num_hidden_layers``,
the tensors keep AngelSpec's names): `load_dflash` hands it to `load_angelspec`, which reads that family.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..configuration_angelspec_dfly import DFlyDrafterConfig
from ..errors import DrafterCheckpointError, DrafterConfigError
from ..modeling_angelspec_dfly import DFlyDrafter
from .angelspec import angelspec_drafter_config, is_angelspec_dflash, load_angelspec
from .checkpoint import (
    PER_LAYER,
    layer_fields,
    load_weights,
    naming_config,
    read_config,
    read_tensors,
    required,
    write_checkpoint,
)

logger = logging.getLogger(__name__)

# Our weight name -> z-lab name; "{i}" is the draft layer.
TOP_LEVEL = {"context_proj.weight": "fc.weight", "context_norm.weight": "hidden_norm.weight", "final_norm.weight": "norm.weight"}


def _name_map(num_layers: int) -> dict[str, str]:
    names = dict(TOP_LEVEL)
    for i in range(num_layers):
        names.update({f"layers.{i}.{ours}": f"layers.{i}.{theirs}" for ours, theirs in PER_LAYER.items()})
    return names


def dflash_config_dict(config: DFlyDrafterConfig) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "max_position_embeddings": 32768,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "num_target_layers": config.num_target_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": config.vocab_size,
        # Ours, ignored by other readers: lets load_dflash restore the target check.
        "angelspec_target": {"name_or_path": config.target_name_or_path,
                             "embedding_fingerprint": config.target_embedding_fingerprint},
    }


def _require_dflash_mode(config) -> None:
    if getattr(config, "variant", None) != "dflash":
        raise DrafterConfigError(
            f"Only DFlash-mode drafters (conditioning='global', hidden_correction=False) map to the DFlash "
            f"format; this one is {getattr(config, 'variant', config.model_type)!r}. Fix: train or convert a "
            "dflash-code recipe drafter, or use --to angelspec for DFly/DFlare drafters."
        )


def export_dflash(drafter: DFlyDrafter, out_dir: str | Path) -> Path:
    """Write a DFlash-mode drafter as a z-lab ``DFlashDraftModel`` checkpoint (config + safetensors)."""
    config = drafter.config
    _require_dflash_mode(config)
    names = _name_map(config.num_hidden_layers)
    weights = drafter.state_dict()
    if weights.pop("draft_vocab", None) is not None:
        # The format drafts over the whole vocabulary: the export is as accurate, only slower to draft.
        logger.warning("The DFlash format has no reduced draft vocabulary; the export drafts over the full vocabulary.")
    return write_checkpoint(out_dir, {names[key]: value for key, value in weights.items()}, dflash_config_dict(config))


def _field(config: dict, name: str):
    nested = config.get("dflash_config") or {}
    value = nested.get(name, config.get(name))
    if value is None:
        raise DrafterCheckpointError(
            f"The DFlash config has no {name!r} (looked in dflash_config and top level). Fix: download the "
            f"checkpoint's config.json again, or add {name!r} to its dflash_config from the model it was trained as."
        )
    return value


def dflash_drafter_config(raw: dict, block_size: int | None = None) -> DFlyDrafterConfig:
    """Our config for a z-lab DFlash config dict (or AngelSpec's DFlash layout, read as such).
    ``block_size`` overrides the recorded one (AngelSpec's layout records none)."""
    if is_angelspec_dflash(raw):
        return angelspec_drafter_config(raw, block_size)
    nested = raw.get("dflash_config") or {}
    recorded = "block_size" in raw or "block_size" in nested
    return DFlyDrafterConfig(
        **layer_fields(raw), num_target_layers=required(raw, "num_target_layers"),
        target_layer_ids=list(_field(raw, "target_layer_ids")),
        block_size=block_size or (int(_field(raw, "block_size")) if recorded else 16),
        mask_token_id=int(_field(raw, "mask_token_id")), conditioning="global", hidden_correction=False,
    )


def load_dflash(path: str | Path, dtype: torch.dtype | None = None, block_size: int | None = None) -> DFlyDrafter:
    """A z-lab DFlash checkpoint directory as a `DFlyDrafter` in DFlash mode (strict: every tensor mapped),
    in ``dtype`` or the file's own. AngelSpec's DFlash layout is read by `load_angelspec`."""
    raw = read_config(path)
    if is_angelspec_dflash(raw):
        return load_angelspec(path, block_size=block_size, dtype=dtype)
    with naming_config(path):
        config = dflash_drafter_config(raw, block_size)
    inverse = {v: k for k, v in _name_map(config.num_hidden_layers).items()}
    what = (f"{path} is not a plain DFlash checkpoint (DFlash2 checkpoints with candidate selectors or convolutions "
            "are not supported)")
    return load_weights(DFlyDrafter(config), read_tensors(path), inverse, what, path, dtype)


# transformers' own DFlash assistant (``speculation_type="dflash"``): the same network under the
# MuseGlimmerAssistant names, with the context projection and its norm in an ``encoder``.
TRANSFORMERS_TOP_LEVEL = {"context_proj.weight": "encoder.fc.weight", "context_norm.weight": "encoder.output_norm_enc.weight",
                          "final_norm.weight": "norm.weight"}


def transformers_dflash_config_dict(config: DFlyDrafterConfig) -> dict:
    return {
        "architectures": ["MuseGlimmerAssistantModel"],
        "model_type": "muse_glimmer_assistant",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": 32768,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "hidden_act": "silu",
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def export_transformers_dflash(drafter: DFlyDrafter, out_dir: str | Path) -> Path:
    """Write a DFlash-mode drafter as transformers' native DFlash assistant, for
    ``target.generate(assistant_model=AutoModel.from_pretrained(out_dir), speculation_type="dflash")``."""
    config = drafter.config
    _require_dflash_mode(config)
    weights = drafter.state_dict()
    weights.pop("draft_vocab", None)
    names = dict(TRANSFORMERS_TOP_LEVEL)
    for i in range(config.num_hidden_layers):
        names.update({f"layers.{i}.{ours}": f"layers.{i}.{theirs}" for ours, theirs in PER_LAYER.items()})
    return write_checkpoint(out_dir, {names[k]: v for k, v in weights.items()}, transformers_dflash_config_dict(config))
