"""Configuration of the AngelSpec MTP drafter (autoregressive head trained with training-time test)."""

from .configuration_angelspec_common import AngelSpecDrafterConfig, check_bool, is_int
from .errors import DrafterConfigError

LAYER_STYLES = ("eagle3", "deepseek")


class MTPDrafterConfig(AngelSpecDrafterConfig):
    """One decoder layer fed by target features, drafting token by token.

    ``num_hidden_layers`` (common field, default 1) > 1 stacks plain decoder layers on that one
    (``eagle3`` style only): each draft step runs them all, and each keeps its own KV cache.

    Args:
        num_draft_tokens: tokens drafted per round at inference (the TTT depth D by default).
        ttt_steps: how many draft steps training unrolls on the drafter's own predictions.
        layer_style: ``"eagle3"`` (default): ``fc`` fuses several target layers and attention reads
            ``[norm(embedding); norm(hidden)]``, 2H wide. ``"deepseek"``: the DeepSeek-V3 MTP layer
            that AngelSpec's ``MTPDraftModel`` trains: it reads only the target's last (final-normed)
            hidden state, ``eh_proj`` fuses ``[norm(embedding); norm(hidden)]`` to H, a standard
            pre-norm decoder layer follows, then a final norm whose output is also what the next
            draft step reads; the embedding at position 0 is zeroed.
        qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3 style); ``None`` turns it on
            for the ``deepseek`` style and off for ``eagle3``.
        draft_vocab_size: (common field) a reduced draft vocabulary gets its own ``lm_head`` and
            EAGLE-3 ``d2t``/``t2d`` maps; ``None`` drafts through the target's ``lm_head``.
    """

    model_type = "angelspec_mtp"

    num_draft_tokens: int = 3
    ttt_steps: int = 3
    layer_style: str = "eagle3"
    qk_norm: bool | None = None

    def _validate_variant(self) -> None:
        if not is_int(self.num_draft_tokens) or self.num_draft_tokens < 1:
            raise DrafterConfigError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}.")
        if not is_int(self.ttt_steps) or self.ttt_steps < 1:
            raise DrafterConfigError(f"ttt_steps must be an integer >= 1, got {self.ttt_steps!r}.")
        if self.layer_style not in LAYER_STYLES:
            raise DrafterConfigError(f"layer_style must be one of {LAYER_STYLES}, got {self.layer_style!r}.")
        if self.qk_norm is None:
            self.qk_norm = self.layer_style == "deepseek"
        check_bool(type(self).__name__, "qk_norm", self.qk_norm)
        if self.layer_style == "deepseek" and self.num_hidden_layers != 1:
            raise DrafterConfigError(
                f"A deepseek-style MTP drafter is one MTP layer (AngelSpec's MTPDraftModel), got num_hidden_layers="
                f"{self.num_hidden_layers}. Fix: num_hidden_layers=1, or layer_style='eagle3' to stack further layers."
            )
        if self.layer_style == "deepseek":
            last = [self.num_target_layers - 1]
            if self.target_layer_ids is None:
                self.target_layer_ids = last
            elif list(self.target_layer_ids) != last:
                raise DrafterConfigError(
                    f"A deepseek-style MTP layer reads only the target's last layer ({last}), got target_layer_ids="
                    f"{self.target_layer_ids}. Fix: leave target_layer_ids unset, or use layer_style='eagle3' to fuse several layers."
                )
