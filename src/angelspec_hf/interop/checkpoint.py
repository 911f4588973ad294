"""Reading and writing a foreign drafter checkpoint directory: config.json plus safetensors."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import DrafterCheckpointError, DrafterConfigError, DrafterTargetMismatchError
from ..modeling_angelspec_common import (
    FINGERPRINT_MIN_COSINE,
    embedding_fingerprint,
    fingerprint_similarity,
    target_config_fields,
    target_name,
)

# Our per-layer weight name -> the Qwen3 name that DFlash-family formats (z-lab's and AngelSpec's) use.
PER_LAYER = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **{f"{name}.weight": f"self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
    **{f"mlp.{name}.weight": f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")},
}
# What a re-download fixes: a file cut short, or config.json and weights from different revisions.
REDOWNLOAD = "Fix: download the checkpoint again (config.json and its .safetensors files from the same revision)."


def write_checkpoint(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """``tensors`` (already under the format's names) as model.safetensors, ``config`` as config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def read_config(path: str | Path) -> dict:
    """The directory's config.json as a dict; a missing or unreadable file is a `DrafterCheckpointError`."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise DrafterCheckpointError(
            f"{file} does not exist: a drafter checkpoint directory holds config.json beside its weights. "
            "Fix: pass the checkpoint's directory, or download its config.json too."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DrafterCheckpointError(f"{file} cannot be read as JSON ({error}). {REDOWNLOAD}") from error
    if not isinstance(raw, dict):
        raise DrafterCheckpointError(f"{file} holds a {type(raw).__name__}, not a JSON object. {REDOWNLOAD}")
    return raw


@contextmanager
def naming_config(path: str | Path) -> Iterator[None]:
    """Config errors raised inside name the checkpoint's config.json: the config builders see only a
    dict, and a user with several checkpoints needs to know which file to fix."""
    file = Path(path) / "config.json"
    try:
        yield
    except (DrafterCheckpointError, DrafterConfigError) as error:
        if str(path) in str(error):
            raise
        raise type(error)(f"{file}: {error}") from error


def required(raw: dict, name: str) -> Any:
    """``raw[name]``; a missing (or null) field is a `DrafterCheckpointError` naming it, not a bare KeyError."""
    value = raw.get(name)
    if value is None:
        raise DrafterCheckpointError(
            f"The config has no {name!r}, which this format must record. Fix: download the checkpoint's config.json "
            f"again, or add {name!r} from the model it was trained as."
        )
    return value


def read_tensors(path: str | Path, ignored: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, without the ``ignored`` names."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DrafterCheckpointError(f"No .safetensors weights in {path}. Fix: download the checkpoint's weight files.")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as error:
            raise DrafterCheckpointError(f"{file} is not a readable safetensors file ({error}). {REDOWNLOAD}") from error
    for name in ignored:
        tensors.pop(name, None)
    return tensors


def stored_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The floating-point dtype holding most of ``tensors``' values (None without float tensors):
    what a reader keeps when no dtype is asked for, so a bf16 file does not come back as float32."""
    counts: Counter[torch.dtype] = Counter()
    for tensor in tensors.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] += tensor.numel()
    return counts.most_common(1)[0][0] if counts else None


def renamed_strictly(theirs: dict[str, torch.Tensor], ours_by_theirs: dict[str, str], what: str) -> dict[str, torch.Tensor]:
    """``theirs`` under our names; any tensor left over or missing is a `DrafterCheckpointError`
    whose message starts with ``what`` (the format and what it does not support)."""
    unknown, missing = sorted(set(theirs) - set(ours_by_theirs)), sorted(set(ours_by_theirs) - set(theirs))
    if unknown or missing:
        raise DrafterCheckpointError(f"{what}: unexpected {unknown[:6]}, missing {missing[:6]}.")
    return {ours_by_theirs[name]: tensor for name, tensor in theirs.items()}


def check_shapes(theirs: dict[str, torch.Tensor], ours_by_theirs: dict[str, str], drafter: torch.nn.Module,
                 path: str | Path) -> None:
    """Refuse a tensor whose shape is not the one config.json implies, under the file's own name
    (torch's size-mismatch error names ours, which the user cannot find in the file)."""
    expected = drafter.state_dict()
    for name, tensor in theirs.items():
        shape = expected[ours_by_theirs[name]].shape
        if tensor.shape != shape:
            raise DrafterCheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, but config.json's sizes give "
                f"{tuple(shape)}. {REDOWNLOAD}"
            )


def load_weights(drafter: torch.nn.Module, theirs: dict[str, torch.Tensor], ours_by_theirs: dict[str, str], what: str,
                 path: str | Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``drafter`` holding ``theirs`` (strict: every tensor mapped and of the configured shape), in
    ``dtype`` or, without one, in the file's own floating-point dtype."""
    ours = renamed_strictly(theirs, ours_by_theirs, what)
    check_shapes(theirs, ours_by_theirs, drafter, path)
    dtype = dtype or stored_dtype(theirs)
    if dtype is not None:
        drafter.to(dtype)  # before loading, so that the stored values are copied once, not via float32
    drafter.load_state_dict(ours, strict=True)
    return drafter


def _rope_types(raw: dict) -> list[str]:
    """Every RoPE type the config asks for (``rope_scaling`` or transformers' newer ``rope_parameters``,
    which may hold one dict per attention type)."""
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if not isinstance(params, dict):
            continue
        nested = [value for value in params.values() if isinstance(value, dict)]
        for entry in nested if nested and len(nested) == len(params) else [params]:
            kind = entry.get("rope_type", entry.get("type"))
            if kind not in (None, "default"):
                found.append(f"{key}.rope_type={kind!r}")
    return found


def unsupported_settings(raw: dict) -> list[str]:
    """The config's settings that change the network and that angelspec-hf drafters do not compute
    (they run plain RoPE, full attention, SiLU MLPs and bias-free projections)."""
    found = _rope_types(raw)
    if raw.get("use_sliding_window"):
        found.append(f"use_sliding_window=True (sliding_window={raw.get('sliding_window')!r})")
    sliding = sorted({kind for kind in raw.get("layer_types") or () if kind != "full_attention"})
    if sliding:
        found.append(f"layer_types containing {sliding}")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        found.append(f"hidden_act={raw['hidden_act']!r}")
    for bias in ("attention_bias", "mlp_bias"):
        if raw.get(bias):
            found.append(f"{bias}={raw[bias]!r}")
    return found


def check_supported_network(raw: dict) -> None:
    found = unsupported_settings(raw)
    if found:
        raise DrafterConfigError(
            f"This checkpoint's config sets {', '.join(found)}, which angelspec-hf drafters do not implement (they "
            "compute plain RoPE, full attention and SiLU MLPs without biases), so it would run as another network than "
            "the one it was trained as. Fix: use a checkpoint trained without these settings, or serve this one with "
            "the engine it was trained for."
        )


def layer_fields(raw: dict) -> dict:
    """Our config fields for the decoder-layer shape of a Llama/Qwen3-style config dict, plus the
    target binding (name, embedding fingerprint) our own exports record under ``angelspec_target``."""
    check_supported_network(raw)
    rope = raw.get("rope_parameters") or {}
    target = raw.get("angelspec_target") or {}
    heads, hidden = required(raw, "num_attention_heads"), required(raw, "hidden_size")
    return {
        "vocab_size": required(raw, "vocab_size"), "hidden_size": hidden,
        "intermediate_size": required(raw, "intermediate_size"), "num_hidden_layers": required(raw, "num_hidden_layers"),
        "num_attention_heads": heads, "num_key_value_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or hidden // heads,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        "target_name_or_path": target.get("name_or_path"), "target_embedding_fingerprint": target.get("embedding_fingerprint"),
    }


def one_layer_fields(raw: dict, format_name: str, target=None, num_target_layers: int | None = None) -> dict:
    """Our config fields for a one-layer drafter whose format does not record the target's depth:
    the target's own fields when it is given, the layer shape, and the depth from ``num_target_layers``,
    our exports' record, or the target. What the file records about its target (our exports do) is
    checked against a given target and kept: the target given cannot re-bind the drafter."""
    fields = target_config_fields(target) if target is not None else {}
    recorded = raw.get("angelspec_target") or {}
    layers = num_target_layers or recorded.get("num_layers") or fields.get("num_target_layers")
    if layers is None:
        raise DrafterConfigError(
            f"An {format_name} config does not say how deep its target is. Fix: pass target=... (angelspec-hf convert "
            "--target ...) or num_target_layers=..."
        )
    shape = layer_fields({**raw, "num_hidden_layers": 1})
    if target is not None:
        check_recorded_target(recorded, target, format_name)
        # The file's record wins where it has one; the target fills what it lacks.
        for key in ("target_name_or_path", "target_embedding_fingerprint"):
            if shape[key] is None:
                shape[key] = fields[key]
    return {**fields, **shape, "num_target_layers": int(layers)}


def recorded_target_mismatches(recorded: dict, target) -> list[str]:
    """How ``target`` differs from what the file records about the target it was trained for."""
    problems = []
    fingerprint = recorded.get("embedding_fingerprint")
    if fingerprint:
        similarity = fingerprint_similarity(fingerprint, embedding_fingerprint(target.get_input_embeddings().weight))
        if similarity < FINGERPRINT_MIN_COSINE:
            problems.append(f"other token embeddings (fingerprint similarity {similarity:.3f} < {FINGERPRINT_MIN_COSINE})")
    depth, target_depth = recorded.get("num_layers"), target.config.get_text_config().num_hidden_layers
    if depth is not None and depth != target_depth:
        problems.append(f"{depth} decoder layers recorded, the target has {target_depth}")
    return problems


def check_recorded_target(recorded: dict, target, format_name: str) -> None:
    """Refuse ``target`` where the file records (our exports do) that it was trained for another one:
    the loaded drafter would otherwise take the target's binding and pass every later check."""
    problems = recorded_target_mismatches(recorded, target)
    if problems:
        raise DrafterTargetMismatchError(
            f"This {format_name} checkpoint records that it was trained for {recorded.get('name_or_path')!r}, "
            f"not for {target_name(target) or type(target).__name__!r}: {'; '.join(problems)}. "
            "Fix: load it with the target it was trained for."
        )
