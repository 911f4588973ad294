"""Typed exceptions of angelspec-hf.

Standard library only: the modeling files import this module relatively, so it ships with them
as Hub remote code. Every class also derives from the builtin exception a caller would expect
(``ValueError``, ``OSError``), so code written against plain ``transformers`` keeps working.
"""


class AngelSpecError(Exception):
    """Base class of every error raised by angelspec-hf."""


class DrafterConfigError(AngelSpecError, ValueError):
    """A drafter configuration or a ``from_target`` override is invalid."""


class DrafterTargetMismatchError(AngelSpecError, ValueError):
    """The drafter was built for another target model (vocabulary, sizes, layers or embeddings differ)."""


class DrafterCheckpointError(AngelSpecError, OSError):
    """A drafter checkpoint is missing weight files, has corrupt ones, or lacks/has unexpected tensors."""


class BatchSizeNotSupportedError(AngelSpecError, ValueError):
    """``target.generate(assistant_model=drafter)`` was called with more than one sequence."""


class UnsupportedGenerationModeError(AngelSpecError, ValueError):
    """``generate`` was asked for a decoding mode (beam search) that transformers runs without the assistant."""


class UnsupportedCacheError(AngelSpecError, ValueError):
    """The target's KV cache cannot be rolled back after a rejected draft."""


class ReferenceTargetError(AngelSpecError, RuntimeError):
    """The bundled reference target could not be obtained or converted."""


class ExactVerificationError(AngelSpecError, RuntimeError):
    """The target's forward could not be made to give a position the same bits alone and among others."""
