"""Configuration of the AngelSpec MTP drafter (autoregressive head trained with training-time test)."""

from .configuration_angelspec_common import AngelSpecDrafterConfig
from .errors import DrafterConfigError


class MTPDrafterConfig(AngelSpecDrafterConfig):
    """One EAGLE-3 style decoder layer fed by fused target features, drafting token by token.

    Args:
        num_draft_tokens: tokens drafted per round at inference (the TTT depth D by default).
        ttt_steps: how many draft steps training unrolls on the drafter's own predictions.
        draft_vocab_size: (common field) a reduced draft vocabulary gets its own ``lm_head`` and
            EAGLE-3 ``d2t``/``t2d`` maps; ``None`` drafts through the target's ``lm_head``.
    """

    model_type = "angelspec_mtp"

    num_draft_tokens: int = 3
    ttt_steps: int = 3

    def __post_init__(self, **kwargs):
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise DrafterConfigError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}.")
        if not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise DrafterConfigError(f"ttt_steps must be an integer >= 1, got {self.ttt_steps!r}.")
        super().__post_init__(**kwargs)
