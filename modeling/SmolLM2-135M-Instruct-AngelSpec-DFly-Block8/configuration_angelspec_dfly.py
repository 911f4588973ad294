"""Configuration of the AngelSpec DFly block-parallel drafter (and its DFlash/DFlare special cases)."""

from .configuration_angelspec_common import AngelSpecDrafterConfig, check_bool, is_int
from .errors import DrafterConfigError

CONDITIONING_MODES = ("global", "layerwise", "hybrid")
NUM_CONTEXT_LAYERS = 5


class DFlyDrafterConfig(AngelSpecDrafterConfig):
    """Drafts ``block_size - 1`` tokens in one forward from the anchor token plus mask tokens.

    Args:
        block_size: anchor plus mask positions per block.
        conditioning: how target layers become each draft layer's context: ``"global"`` (DFlash's
            fused projection), ``"layerwise"`` (DFlare's learned per-layer mix) or ``"hybrid"``
            (RMSNorm of their sum, DFly).
        hidden_correction: run the left-to-right correction head on the previous drafted token.
            ``conditioning="global", hidden_correction=False`` is exactly DFlash;
            ``conditioning="layerwise", hidden_correction=False`` is DFlare.
        correction_intermediate_size: width of the correction head's SwiGLU (default: hidden size).
        correction_embed_norm: RMSNorm the previous token's embedding before the correction head,
            as published AngelSpec DFly checkpoints do (``from_target`` turns it on; configs
            written before it existed load with it off).
        mask_token_id: target token id used for masked block positions.
    """

    model_type = "angelspec_dfly"

    num_hidden_layers: int = 2
    block_size: int = 8
    conditioning: str = "hybrid"
    hidden_correction: bool = True
    correction_intermediate_size: int | None = None
    correction_embed_norm: bool = False
    mask_token_id: int = 0

    checkpoint_fields = (*AngelSpecDrafterConfig.checkpoint_fields, "block_size", "mask_token_id", "conditioning",
                         "hidden_correction")

    def _validate_variant(self) -> None:
        if not is_int(self.block_size) or self.block_size < 2:
            raise DrafterConfigError(f"block_size must be an integer >= 2 (anchor + masks), got {self.block_size!r}.")
        if self.conditioning not in CONDITIONING_MODES:
            raise DrafterConfigError(
                f"conditioning must be one of {CONDITIONING_MODES}, got {self.conditioning!r}."
            )
        for name in ("hidden_correction", "correction_embed_norm"):
            check_bool(type(self).__name__, name, getattr(self, name))
        if not is_int(self.mask_token_id) or not 0 <= self.mask_token_id < self.vocab_size:
            raise DrafterConfigError(
                f"mask_token_id must be an integer token id of the target vocabulary (0..{self.vocab_size - 1}), "
                f"got {self.mask_token_id!r}."
            )
        if self.correction_intermediate_size is None:
            self.correction_intermediate_size = self.hidden_size
        size = self.correction_intermediate_size
        if not is_int(size) or size < 1:
            raise DrafterConfigError(f"correction_intermediate_size must be a positive integer (or None: the hidden "
                                     f"size), got {size!r}.")

    @staticmethod
    def default_target_layer_ids(num_target_layers: int) -> list[int]:
        """Evenly spaced from layer 1 to layer L-3 (DFlash convention)."""
        start, end = min(1, num_target_layers - 1), max(num_target_layers - 3, 0)
        count = min(NUM_CONTEXT_LAYERS, end - start + 1)
        if count <= 1:
            return [start]
        return sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)})

    @property
    def variant(self) -> str:
        """Which published method this configuration reproduces."""
        if not self.hidden_correction and self.conditioning == "global":
            return "dflash"
        if not self.hidden_correction and self.conditioning == "layerwise":
            return "dflare"
        return "dfly"
