"""What growing a trained drafter by layers shares across drafter families (`block.grow_layers`,
`mtp.grow_mtp_layers`): the checks and the deeper, still untrained model to load into."""

from __future__ import annotations


def deeper_model(drafter, model_class: type, num_hidden_layers: int, what: str):
    """An untrained ``model_class`` with ``drafter``'s config but ``num_hidden_layers`` layers, on
    its device and dtype, and ``drafter``'s state dict, which the caller completes and loads; a
    depth the drafter's config does not allow is its `DrafterConfigError`.
    ``what`` names the drafters the caller grows, for the error."""
    if not isinstance(drafter, model_class):
        raise TypeError(f"this grows {what} drafters; got {type(drafter).__name__}.")
    old = drafter.config.num_hidden_layers
    if not isinstance(num_hidden_layers, int) or num_hidden_layers <= old:
        raise ValueError(f"growing needs more layers than the drafter's {old}; got {num_hidden_layers!r}.")
    # Rebuilt through the config class, not copied and patched, so that its checks see the new depth
    # (a deepseek-style MTP layer, for one, cannot have layers stacked on it).
    config = type(drafter.config).from_dict({**drafter.config.to_dict(), "num_hidden_layers": num_hidden_layers})
    return model_class(config).to(device=drafter.device, dtype=drafter.dtype), drafter.state_dict()
