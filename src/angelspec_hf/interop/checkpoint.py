"""Reading and writing a foreign drafter checkpoint directory: config.json plus safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import DrafterCheckpointError, DrafterConfigError, DrafterTargetMismatchError
from ..modeling_angelspec_common import (
    FINGERPRINT_MIN_COSINE,
    embedding_fingerprint,
    fingerprint_similarity,
    target_config_fields,
    target_name,
)


def write_checkpoint(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """``tensors`` (already under the format's names) as model.safetensors, ``config`` as config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def read_tensors(path: str | Path, ignored: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, without the ``ignored`` names."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DrafterCheckpointError(f"No .safetensors weights in {path}. Fix: download the checkpoint's weight files.")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    for name in ignored:
        tensors.pop(name, None)
    return tensors


def renamed_strictly(theirs: dict[str, torch.Tensor], ours_by_theirs: dict[str, str], what: str) -> dict[str, torch.Tensor]:
    """``theirs`` under our names; any tensor left over or missing is a `DrafterCheckpointError`
    whose message starts with ``what`` (the format and what it does not support)."""
    unknown, missing = sorted(set(theirs) - set(ours_by_theirs)), sorted(set(ours_by_theirs) - set(theirs))
    if unknown or missing:
        raise DrafterCheckpointError(f"{what}: unexpected {unknown[:6]}, missing {missing[:6]}.")
    return {ours_by_theirs[name]: tensor for name, tensor in theirs.items()}


def layer_fields(raw: dict) -> dict:
    """Our config fields for the decoder-layer shape of a Llama/Qwen3-style config dict, plus the
    target binding (name, embedding fingerprint) our own exports record under ``angelspec_target``."""
    rope = raw.get("rope_parameters") or {}
    target = raw.get("angelspec_target") or {}
    return {
        "vocab_size": raw["vocab_size"], "hidden_size": raw["hidden_size"], "intermediate_size": raw["intermediate_size"],
        "num_hidden_layers": raw["num_hidden_layers"], "num_attention_heads": raw["num_attention_heads"],
        "num_key_value_heads": raw.get("num_key_value_heads", raw["num_attention_heads"]),
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        "target_name_or_path": target.get("name_or_path"), "target_embedding_fingerprint": target.get("embedding_fingerprint"),
    }


def one_layer_fields(raw: dict, format_name: str, target=None, num_target_layers: int | None = None) -> dict:
    """Our config fields for a one-layer drafter whose format does not record the target's depth:
    the target's own fields when it is given (its binding wins over what the file recorded), the
    layer shape, and the depth from ``num_target_layers``, the target, or our exports' record."""
    fields = target_config_fields(target) if target is not None else {}
    layers = num_target_layers or fields.get("num_target_layers") or (raw.get("angelspec_target") or {}).get("num_layers")
    if layers is None:
        raise DrafterConfigError(
            f"An {format_name} config does not say how deep its target is. Fix: pass target=... (angelspec-hf convert "
            "--target ...) or num_target_layers=..."
        )
    shape = layer_fields({**raw, "num_hidden_layers": 1})
    if target is not None:
        recorded = {key: shape.pop(key) for key in ("target_name_or_path", "target_embedding_fingerprint")}
        check_recorded_target(recorded, target, format_name)
    return {**fields, **shape, "num_target_layers": int(layers)}


def check_recorded_target(recorded: dict, target, format_name: str) -> None:
    """Refuse ``target`` where the file records (our exports do) the embeddings of another one: given a
    target, the loaded drafter is bound to it, so a file trained for another would pass every later check."""
    fingerprint = recorded.get("target_embedding_fingerprint")
    if not fingerprint:
        return
    similarity = fingerprint_similarity(fingerprint, embedding_fingerprint(target.get_input_embeddings().weight))
    if similarity < FINGERPRINT_MIN_COSINE:
        raise DrafterTargetMismatchError(
            f"This {format_name} checkpoint records that it was trained for {recorded.get('target_name_or_path')!r}, "
            f"not for {target_name(target) or type(target).__name__!r}: other token embeddings (fingerprint "
            f"similarity {similarity:.3f} < {FINGERPRINT_MIN_COSINE}). Fix: load it with the target it was trained for."
        )
