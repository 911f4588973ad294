"""Configuration fields every AngelSpec drafter shares: what it reads from its target.

A drafter borrows its target's embeddings and ``lm_head``, so its config records enough about the
target (sizes, layer count, embedding fingerprint) to refuse the wrong one with a clear error.
"""

import math

from transformers import PretrainedConfig

from .errors import DrafterCheckpointError, DrafterConfigError


class AngelSpecDrafterConfig(PretrainedConfig):
    """Base configuration of AngelSpec drafters; use `MTPDrafterConfig` or `DFlyDrafterConfig`.

    Target-derived fields are normally filled by ``Drafter.from_target(target)``:
    ``vocab_size``/``hidden_size``/``num_target_layers`` must equal the target's,
    ``target_layer_ids`` are decoder-layer indices whose outputs (``hidden_states[i + 1]``) the
    drafter reads, ``target_embedding_fingerprint`` is a small sample of the target's input
    embedding matrix (see ``embedding_fingerprint``). ``draft_vocab_size`` (``None``: the full
    vocabulary) limits drafting to that many target tokens, stored with the weights; on a CPU the
    full ``lm_head`` per drafted token costs more than the rest of the drafter.
    """

    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 1
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    num_target_layers: int = 30
    target_layer_ids: list[int] | None = None
    target_name_or_path: str | None = None
    target_revision: str | None = None
    target_model_type: str | None = None
    target_embedding_fingerprint: list[float] | None = None
    tie_word_embeddings: bool = False
    draft_vocab_size: int | None = None

    # Fields a saved drafter's config.json must hold: its shape and the target binding. Missing, they
    # took class defaults (a vocabulary of 32000, default layers, no fingerprint: the wrong-target
    # check off) and the drafter loaded as another network. Fields added after drafters were shipped
    # keep their defaults for old files.
    checkpoint_fields: tuple[str, ...] = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "num_target_layers", "target_layer_ids", "target_embedding_fingerprint",
    )

    def __post_init__(self, **kwargs):
        if self.target_layer_ids is None:
            self.target_layer_ids = self.default_target_layer_ids(self.num_target_layers)
        self._validate_common()
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """A config as read from a checkpoint (``from_pretrained``, ``AutoConfig``): every field of
        `checkpoint_fields` must be there, or `DrafterCheckpointError` names the missing ones."""
        missing = [name for name in cls.checkpoint_fields if name not in config_dict]
        if missing:
            raise DrafterCheckpointError(
                f"This {cls.__name__} config lacks {missing}, which a saved drafter records (its shape and the "
                "target it was built for). Fix: re-save the drafter with save_pretrained(), or re-download its "
                "config.json if it was cut or edited."
            )
        return super().from_dict(config_dict, **kwargs)

    @staticmethod
    def default_target_layer_ids(num_target_layers: int) -> list[int]:
        """Low, middle and high layers (EAGLE-3 convention); subclasses override."""
        return sorted({min(1, num_target_layers - 1), max(num_target_layers // 2 - 1, 0), max(num_target_layers - 4, 0)})

    def _validate_common(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "num_target_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise DrafterConfigError(f"{type(self).__name__}.{name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})."
            )
        if self.draft_vocab_size is not None and (
            not isinstance(self.draft_vocab_size, int) or not 1 <= self.draft_vocab_size <= self.vocab_size
        ):
            raise DrafterConfigError(
                f"draft_vocab_size must be between 1 and the target vocabulary ({self.vocab_size}), "
                f"got {self.draft_vocab_size!r}; use None for the full vocabulary."
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise DrafterConfigError(f"{type(self).__name__}.{name} must be a positive number, got {value!r}.")
        fingerprint = self.target_embedding_fingerprint
        if fingerprint is not None and not (isinstance(fingerprint, (list, tuple)) and fingerprint and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in fingerprint)):
            raise DrafterConfigError("target_embedding_fingerprint must be a list of numbers (see embedding_fingerprint) "
                                     f"or None, got {fingerprint!r:.80}.")
        if not self.target_layer_ids:
            raise DrafterConfigError("target_layer_ids is empty: list the target decoder layers the drafter reads.")
        bad = [i for i in self.target_layer_ids if not isinstance(i, int) or not 0 <= i < self.num_target_layers]
        if bad:
            raise DrafterConfigError(
                f"target_layer_ids {bad} are outside the target's decoder layers 0..{self.num_target_layers - 1}."
            )

    @property
    def uses_reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.vocab_size
