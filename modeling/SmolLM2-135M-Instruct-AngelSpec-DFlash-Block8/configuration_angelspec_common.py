"""Configuration fields every AngelSpec drafter shares: what it reads from its target.

A drafter borrows its target's embeddings and ``lm_head``, so its config records enough about the
target (sizes, layer count, embedding fingerprint) to refuse the wrong one with a clear error.
"""

import math

from transformers import PretrainedConfig

from .errors import DrafterCheckpointError, DrafterConfigError

# What `embedding_fingerprint` samples: a few columns of fixed embedding rows. Here so that a config
# can check a stored fingerprint's length (a wrong one made every target look like another one).
FINGERPRINT_ROWS = 16
FINGERPRINT_DIMS = 8


def is_int(value) -> bool:
    """An integer as JSON gives one: ``True`` and ``4.0`` are not (bool is an int subclass)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite JSON number (``True`` is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_positive_number(value) -> bool:
    return is_number(value) and value > 0


def check_positive_int(owner: str, name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise DrafterConfigError(f"{owner}.{name} must be a positive integer, got {value!r}. Fix: set it in config.json "
                                 "or re-save the drafter with save_pretrained().")


def check_bool(owner: str, name: str, value) -> None:
    # A JSON string "false" is truthy: it would switch the module on.
    if not isinstance(value, bool):
        raise DrafterConfigError(f"{owner}.{name} must be true or false, got {value!r} ({type(value).__name__}). "
                                 "Fix: write a JSON boolean in config.json.")


def expected_fingerprint_length(hidden_size: int) -> int:
    return FINGERPRINT_ROWS * min(FINGERPRINT_DIMS, hidden_size)


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
        self._validate_sizes()
        self._validate_variant()
        if self.target_layer_ids is None:
            self.target_layer_ids = self.default_target_layer_ids(self.num_target_layers)
        self._validate_common()
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """A config as read from a checkpoint (``from_pretrained``, ``AutoConfig``): every field of
        `checkpoint_fields` must be there, or `DrafterCheckpointError` names the missing ones."""
        missing = [name for name in cls.checkpoint_fields if name not in config_dict]
        if len(missing) == len(cls.checkpoint_fields):
            # Nothing of a drafter at all: config.json is absent (transformers then gives {}), empty or another file.
            raise DrafterCheckpointError(
                f"Found no {cls.__name__} config: config.json is missing or empty, or not a drafter's (it lacks "
                f"{missing}). Fix: point to the directory (or subfolder) drafter.save_pretrained() wrote, or "
                "re-download config.json."
            )
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

    def _validate_sizes(self) -> None:
        """Types and ranges of the fields that do not depend on others; subclasses call it before
        their own checks, which compare against these (a string ``vocab_size`` gave a bare TypeError)."""
        owner = type(self).__name__
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "num_target_layers"):
            check_positive_int(owner, name, getattr(self, name))
        # A string loaded and failed in generate with a bare TypeError; a negative epsilon or theta
        # drafted NaN or garbage without a word.
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if not is_positive_number(value):
                raise DrafterConfigError(f"{owner}.{name} must be a positive number, got {value!r}. Fix: write a "
                                         "positive JSON number in config.json.")
        for name in ("target_name_or_path", "target_revision", "target_model_type"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise DrafterConfigError(f"{owner}.{name} must be a string or null, got {value!r}.")

    def _validate_variant(self) -> None:
        """A subclass's checks (and defaults) of its own fields: after the shared sizes, which they
        compare against, and before the target layers, which they may set."""

    def _validate_common(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})."
            )
        if self.draft_vocab_size is not None and (
            not is_int(self.draft_vocab_size) or not 1 <= self.draft_vocab_size <= self.vocab_size
        ):
            raise DrafterConfigError(
                f"draft_vocab_size must be between 1 and the target vocabulary ({self.vocab_size}), "
                f"got {self.draft_vocab_size!r}; use None for the full vocabulary."
            )
        self._validate_fingerprint()
        self._validate_target_layer_ids()

    def _validate_fingerprint(self) -> None:
        fingerprint = self.target_embedding_fingerprint
        if fingerprint is None:
            return
        if not (isinstance(fingerprint, (list, tuple)) and fingerprint and all(map(is_number, fingerprint))):
            raise DrafterConfigError("target_embedding_fingerprint must be a list of numbers (see embedding_fingerprint) "
                                     f"or None, got {fingerprint!r:.80}.")
        # Of another length it never matched, and every target was refused as "not the one it was built for".
        length = expected_fingerprint_length(self.hidden_size)
        if len(fingerprint) != length:
            raise DrafterConfigError(
                f"target_embedding_fingerprint has {len(fingerprint)} values, not the {length} that "
                f"embedding_fingerprint gives for hidden size {self.hidden_size}. Fix: re-save the drafter with "
                "save_pretrained(), or set it to embedding_fingerprint(target.get_input_embeddings().weight)."
            )

    def _validate_target_layer_ids(self) -> None:
        ids = self.target_layer_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise DrafterConfigError(f"target_layer_ids must be a non-empty list of the target decoder layers the "
                                     f"drafter reads, got {ids!r}.")
        not_ints = [i for i in ids if not is_int(i)]
        if not_ints:
            raise DrafterConfigError(f"target_layer_ids must be integers (decoder layer indices), got {not_ints}. "
                                     "Fix: write them as JSON integers, e.g. 1 rather than 1.0.")
        bad = [i for i in ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise DrafterConfigError(
                f"target_layer_ids {bad} are outside the target's decoder layers 0..{self.num_target_layers - 1}."
            )

    @property
    def uses_reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.vocab_size
