"""AngelSpec's single-head MTP format (``MTPDraftModel``, ``model_type="mtp"``): the DeepSeek-V3 /
Hy3 MTP layer, which is our MTP drafter with ``layer_style="deepseek"``.

``enorm(embed(token t+1))`` and ``hnorm(h_t)`` (the target's last hidden state) are concatenated,
``eh_proj`` maps them to H, one Qwen3-style decoder layer (QK-norm attention, dense SwiGLU) and
``final_layernorm`` follow, and the target's own ``lm_head`` (tied, not stored) gives the logits.
Weight names: ``enorm``/``hnorm``/``eh_proj``/``final_layernorm`` at the top, the decoder layer
under ``midlayer.``, plus the target's ``embed_tokens`` (frozen, kept for their loader).

What the format leaves open, and what we do:
- which last hidden state: AngelSpec's HF and SGLang capture paths train on the final-normed
  state (``last_hidden_states_prenorm=False``), which is ``hidden_states[-1]`` in ``transformers``
  and what we feed; a checkpoint trained on vLLM's pre-norm capture still runs losslessly, with
  lower acceptance.
- the target's depth: not recorded, so importing needs the target (or ``num_target_layers``);
  our exports add it under ``angelspec_target``, as the other formats do.
- the draft depth: the serving engine's ``num_speculative_tokens``; ours goes under ``angelspec_draft``.
Hy3's mixture-of-experts MTP layer (``mlp_type="moe"``) has no counterpart here and is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..configuration_angelspec_mtp import MTPDrafterConfig
from ..errors import DrafterCheckpointError, DrafterConfigError, DrafterTargetMismatchError
from ..modeling_angelspec_common import embedding_fingerprint
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

EMBEDDING = "embed_tokens.weight"
# Our weight name -> MTPDraftModel name.
NAMES = {
    "input_norm.weight": "enorm.weight",
    "hidden_norm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "attention_norm.weight": "midlayer.input_layernorm.weight",
    **{f"self_attn.{name}.weight": f"midlayer.self_attn.{name}.weight"
       for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
    "post_attention_norm.weight": "midlayer.post_attention_layernorm.weight",
    **{f"mlp.{name}.weight": f"midlayer.mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")},
    "norm.weight": "final_layernorm.weight",
}
QK_NORMS = ("midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight")
# Only sizes a serving engine's rotary cache; the target's own limit is written when known.
DEFAULT_MAX_POSITIONS = 32768


def mtp_config_dict(config: MTPDrafterConfig, max_position_embeddings: int = DEFAULT_MAX_POSITIONS) -> dict:
    return {
        "architectures": ["MTPDraftModel"],
        "model_type": "mtp",
        "mlp_type": "dense",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "qk_norm": bool(config.qk_norm),
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "target_hidden_size": config.hidden_size,
        "tie_lm_head": True,
        "mtp_init_from_target_layer": None,
        "tie_word_embeddings": False,
        "angelspec_target": {"name_or_path": config.target_name_or_path, "num_layers": config.num_target_layers,
                             "embedding_fingerprint": config.target_embedding_fingerprint},
        "angelspec_draft": {"num_draft_tokens": config.num_draft_tokens, "ttt_steps": config.ttt_steps},
    }


def export_angelspec_mtp(drafter: MTPDrafter, out_dir: str | Path, target) -> Path:
    """Write a DeepSeek-style MTP drafter as an AngelSpec ``MTPDraftModel`` checkpoint.

    ``target`` supplies the embedding matrix the format stores beside the layer (and is checked
    to be the drafter's target).
    """
    config = drafter.config
    if config.model_type != "angelspec_mtp" or config.layer_style != "deepseek":
        raise DrafterConfigError(
            "AngelSpec's MTPDraftModel is the DeepSeek-style MTP layer; this drafter is "
            f"{getattr(config, 'layer_style', config.model_type)!r}. Fix: train one with "
            "MTPDrafter.from_target(target, layer_style='deepseek') (recipe mtp-chat-deepseek), or export "
            "an EAGLE-3 style MTP drafter with --to eagle3."
        )
    if config.uses_reduced_vocab:
        raise DrafterConfigError(
            f"MTPDraftModel drafts through the target's full lm_head; this drafter has its own {config.draft_vocab_size}-token "
            "head. Fix: train the deepseek-style drafter with draft_vocab_size=None, or keep the angelspec-hf format."
        )
    if target is None:
        raise DrafterConfigError("MTPDraftModel stores the target's token embeddings. Fix: pass the target (--target ...).")
    drafter.check_target(target)
    weights = {NAMES[key]: value for key, value in drafter.state_dict().items()}
    weights[EMBEDDING] = target.get_input_embeddings().weight.detach().to(drafter.dtype)
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS
    return write_checkpoint(out_dir, weights, mtp_config_dict(config, max_positions))


def _check_supported(raw: dict) -> None:
    if (raw.get("architectures") or [""])[0] != "MTPDraftModel" and raw.get("model_type") != "mtp":
        raise DrafterCheckpointError(
            f"Not an AngelSpec MTPDraftModel config (architectures={raw.get('architectures')}, model_type={raw.get('model_type')!r})."
        )
    if raw.get("mlp_type", "moe") != "dense":
        raise DrafterConfigError(
            "This MTPDraftModel has a mixture-of-experts layer (Hy3 style, mlp_type='moe'); angelspec-hf runs the dense "
            "MTP layer of dense targets (mlp_type='dense', e.g. Qwen3 and Llama) only."
        )
    hidden_size = required(raw, "hidden_size")
    if raw.get("target_hidden_size", hidden_size) != hidden_size:
        raise DrafterConfigError(
            f"This MTP layer is {hidden_size} wide for a {raw['target_hidden_size']}-wide target (it has a "
            "hidden_proj); angelspec-hf MTP drafters share the target's width."
        )
    if raw.get("tie_lm_head") is False:
        raise DrafterConfigError("This MTPDraftModel has an untied lm_head; angelspec-hf reads the tied (target lm_head) layout.")


def mtp_drafter_config(raw: dict, target=None, num_target_layers: int | None = None,
                       embedding: torch.Tensor | None = None) -> MTPDrafterConfig:
    """Our config for an MTPDraftModel config dict; the target (or its depth) fills what the format lacks."""
    _check_supported(raw)
    fields = one_layer_fields(raw, "MTPDraftModel", target, num_target_layers)
    if fields["target_embedding_fingerprint"] is None and embedding is not None:
        fields["target_embedding_fingerprint"] = embedding_fingerprint(embedding)
    fields.update(target_layer_ids=None, layer_style="deepseek", qk_norm=bool(raw.get("qk_norm", True)),
                  draft_vocab_size=None, **(raw.get("angelspec_draft") or {}))
    return MTPDrafterConfig(**fields)


def load_angelspec_mtp(path: str | Path, target=None, num_target_layers: int | None = None,
                       dtype: torch.dtype | None = None) -> MTPDrafter:
    """An AngelSpec ``MTPDraftModel`` checkpoint directory as a DeepSeek-style `MTPDrafter` (strict).

    The stored embedding matrix, when there is one, is the target the layer was trained for: a
    ``target`` whose embeddings differ is refused here, and without one its fingerprint is kept so
    that ``generate`` refuses the wrong target later.
    """
    raw = read_config(path)
    theirs = read_tensors(path)
    embedding = theirs.pop(EMBEDDING, None)
    with naming_config(path):
        config = mtp_drafter_config(raw, target, num_target_layers, embedding)
    if embedding is not None and target is not None:
        own = target.get_input_embeddings().weight.detach().cpu()
        if embedding.shape != own.shape or not torch.allclose(embedding.to(own.dtype), own, atol=1e-2, rtol=1e-2):
            raise DrafterTargetMismatchError(
                f"{path} was trained with other token embeddings than {config.target_name_or_path or 'this target'}'s "
                f"(its embed_tokens {tuple(embedding.shape)}). Fix: load it with the target it was trained for."
            )
    inverse = {name: ours for ours, name in NAMES.items() if config.qk_norm or name not in QK_NORMS}
    drafter = load_weights(MTPDrafter(config), theirs, inverse, f"{path} is not a dense AngelSpec MTPDraftModel checkpoint",
                           path, dtype)
    if target is not None:
        drafter.check_target(target)  # the file's own sizes (vocabulary, width) against the target's
    return drafter
