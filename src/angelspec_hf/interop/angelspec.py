"""The AngelSpec training-export format of block drafters (``Qwen3DFlyModel``, and DFlare as
``DFlashDraftModel`` with ``model_arch="dflare"``), as served by AngelSpec's vLLM integration.

Their tensors are ours under other names inside each layer and the correction head: top-level
``context_proj``/``context_norm``/``final_norm``/``layer_fusion_weights`` keep their names (vLLM
maps them onto its DFlash backbone), layer tensors use Qwen3 names (``self_attn.q_proj``,
``input_layernorm``...), and the correction head is ``hidden_correction.{hidden_norm, embed_norm,
gate_proj, up_proj, down_proj}``: ``h + down(silu(gate(x)) * up(x))`` with
``x = [norm(h); norm(e_prev)]``, which is our head with ``correction_embed_norm=True``. The config
records the fused layers (``target_layer_ids``, ``num_target_layers`` = how many) and the target's
depth (``target_num_hidden_layers``), not the block size (the serving engine's
``num_speculative_tokens``); a written ``block_size`` is read, else the block size must be given.
DFlash-mode drafters are exported in the z-lab format (`export_dflash`), which AngelSpec reads as
well; AngelSpec's own DFlash checkpoints (``DFlashDraftModel``, ``model_type="dflash"``, this
format's layout without the per-layer mix) are read here as DFlash-mode drafters.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..configuration_angelspec_dfly import DFlyDrafterConfig
from ..errors import DrafterCheckpointError, DrafterConfigError
from ..modeling_angelspec_dfly import DFlyDrafter
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

TOP_LEVEL = {name: name for name in ("context_proj.weight", "context_norm.weight", "final_norm.weight", "layer_fusion_weights")}
CORRECTION = {
    "hidden_correction.norm.weight": "hidden_correction.hidden_norm.weight",
    "hidden_correction.embed_norm.weight": "hidden_correction.embed_norm.weight",
    **{f"hidden_correction.mlp.{n}.weight": f"hidden_correction.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")},
}
IGNORED = ("embed_tokens.weight",)
DFLY_ARCHITECTURES = ("Qwen3DFlyModel", "DFlyDraftModel")


def is_angelspec_dflash(raw: dict) -> bool:
    """AngelSpec's DFlash (``DFlashDraftModel`` with ``model_type="dflash"``, not DFlare), told from z-lab's
    ``DFlashDraftModel`` (``model_type="qwen3"``, whose ``num_target_layers`` is the target's depth)
    by its ``target_num_hidden_layers``, which only AngelSpec's layout records."""
    architecture = (raw.get("architectures") or [""])[0]
    return (architecture == "DFlashDraftModel" and raw.get("model_arch", "dflash") == "dflash"
            and (raw.get("model_type") == "dflash" or "target_num_hidden_layers" in raw))


def their_name(key: str) -> str:
    """The AngelSpec name of one of our tensor names."""
    if key in TOP_LEVEL or key in CORRECTION:
        return TOP_LEVEL.get(key) or CORRECTION[key]
    prefix, index, rest = key.split(".", 2)
    if prefix != "layers" or rest not in PER_LAYER:
        raise KeyError(key)
    return f"layers.{index}.{PER_LAYER[rest]}"


def _name_map(drafter: DFlyDrafter) -> dict[str, str]:
    return {key: their_name(key) for key in drafter.state_dict() if key != "draft_vocab"}


def angelspec_config_dict(config: DFlyDrafterConfig) -> dict:
    common = {
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size, "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "num_target_layers": len(config.target_layer_ids), "target_hidden_size": config.hidden_size,
        "target_num_hidden_layers": config.num_target_layers, "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id, "block_size": config.block_size, "tie_word_embeddings": False,
        "angelspec_target": {"name_or_path": config.target_name_or_path,
                             "embedding_fingerprint": config.target_embedding_fingerprint},
    }
    if config.variant == "dflare":
        return {"architectures": ["DFlashDraftModel"], "model_type": "dflash", "model_arch": "dflare", **common}
    return {"architectures": ["Qwen3DFlyModel"], "model_type": "qwen3", "model_arch": "dfly", **common,
            "enable_hidden_correction": config.hidden_correction,
            "hidden_correction_intermediate_size": config.correction_intermediate_size}


def export_angelspec(drafter: DFlyDrafter, out_dir: str | Path) -> Path:
    """Write a DFly (hybrid conditioning) or DFlare drafter in the AngelSpec format."""
    config = drafter.config
    if config.model_type != "angelspec_dfly" or config.variant == "dflash" or (
        config.variant == "dfly" and config.conditioning != "hybrid"
    ):
        raise DrafterConfigError(
            "The AngelSpec format holds DFly drafters with hybrid conditioning (Qwen3DFlyModel) and DFlare drafters; "
            f"this one is {getattr(config, 'variant', config.model_type)!r} with {getattr(config, 'conditioning', '?')!r} "
            "conditioning. Fix: DFlash-mode drafters go to --to dflash, MTP drafters to --to eagle3."
        )
    if config.hidden_correction and not config.correction_embed_norm:
        raise DrafterConfigError(
            "AngelSpec's correction head normalises the previous token's embedding; this drafter's head "
            "(built before correction_embed_norm existed) does not, so no AngelSpec checkpoint computes what it does. "
            "Fix: retrain it with a current DFlyDrafter.from_target, or keep the angelspec-hf format."
        )
    weights = drafter.state_dict()
    if weights.pop("draft_vocab", None) is not None:
        logger.warning("The AngelSpec format has no target-row draft vocabulary; the export drafts over the full vocabulary.")
    names = _name_map(drafter)
    return write_checkpoint(out_dir, {names[k]: v for k, v in weights.items()}, angelspec_config_dict(config))


def _variant(raw: dict) -> str:
    """Which AngelSpec block drafter the config describes: "dfly", "dflare" or "dflash"."""
    architecture = (raw.get("architectures") or [""])[0]
    if raw.get("model_arch") == "dflare":
        return "dflare"
    if is_angelspec_dflash(raw):
        if raw.get("fusion_type", "concat_fc") != "concat_fc":
            raise DrafterConfigError(
                f"This AngelSpec DFlash drafter fuses the target layers with fusion_type={raw['fusion_type']!r} "
                "(a gated sum); angelspec-hf runs DFlash's concatenation and linear projection (concat_fc) only."
            )
        return "dflash"
    if architecture in DFLY_ARCHITECTURES:
        return "dfly"
    raise DrafterCheckpointError(
        f"Not an AngelSpec DFly/DFlare/DFlash config (architectures={raw.get('architectures')}, "
        f"model_type={raw.get('model_type')!r}, model_arch={raw.get('model_arch')!r}). Fix: z-lab / SpecForge "
        "DFlash checkpoints (model_type 'qwen3' with dflash_config) load with load_dflash, EAGLE-3 ones with load_eagle3."
    )


def angelspec_drafter_config(raw: dict, block_size: int | None = None) -> DFlyDrafterConfig:
    """Our config for an AngelSpec DFly/DFlare/DFlash config dict."""
    variant = _variant(raw)
    nested = {**(raw.get("dflash_config") or {}), **(raw.get("dflare_config") or {})}
    layer_ids = nested.get("target_layer_ids") or raw.get("target_layer_ids")
    depth = raw.get("target_num_hidden_layers")
    if not layer_ids or depth is None:
        raise DrafterCheckpointError(
            "The config lacks target_layer_ids or target_num_hidden_layers (the target's depth, which AngelSpec "
            "records beside num_target_layers, the count of fused layers). Fix: add them from the training config."
        )
    hidden_size = required(raw, "hidden_size")
    if raw.get("target_hidden_size", hidden_size) != hidden_size:
        raise DrafterConfigError("DFly drafters share the target's width; this config's target_hidden_size differs.")
    block = block_size or raw.get("block_size") or nested.get("block_size")
    if block is None:
        raise DrafterConfigError(
            "This AngelSpec config does not record the block size (vLLM takes it as num_speculative_tokens + 1). "
            "Fix: pass block_size=... (angelspec-hf convert --block-size N)."
        )
    mask_token_id = nested.get("mask_token_id", raw.get("mask_token_id"))
    if mask_token_id is None:
        raise DrafterCheckpointError("The config has no 'mask_token_id'. Fix: add the one the drafter was trained with.")
    correction = bool(raw.get("enable_hidden_correction", False)) and variant == "dfly"
    conditioning = {"dfly": "hybrid", "dflare": "layerwise", "dflash": "global"}[variant]
    return DFlyDrafterConfig(
        **layer_fields(raw), num_target_layers=int(depth), target_layer_ids=list(layer_ids), block_size=int(block),
        mask_token_id=int(mask_token_id), conditioning=conditioning, hidden_correction=correction,
        correction_intermediate_size=raw.get("hidden_correction_intermediate_size"), correction_embed_norm=correction,
    )


def load_angelspec(path: str | Path, block_size: int | None = None, dtype: torch.dtype | None = None) -> DFlyDrafter:
    """An AngelSpec DFly/DFlare/DFlash checkpoint directory as a `DFlyDrafter` (strict: every tensor
    mapped), in ``dtype`` or the file's own."""
    with naming_config(path):
        config = angelspec_drafter_config(read_config(path), block_size)
    drafter = DFlyDrafter(config)
    inverse = {v: k for k, v in _name_map(drafter).items()}
    what = (f"{path} is not a plain AngelSpec DFly/DFlare/DFlash checkpoint (drafters with their own lm_head, "
            "Markov or confidence heads are not supported)")
    return load_weights(drafter, read_tensors(path, IGNORED), inverse, what, path, dtype)
