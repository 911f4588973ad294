"""Target states of training rows, computed once and kept on disk.

On a CPU the frozen target's forward is a third to a half of an MTP or DFly training step, and
every row is read several times (epochs, the LK and TV stages, later runs on the same data).
`FeatureCache` stores, per row, the drafter's input layers and the target's final (normed)
hidden state, which is the soft label: ``lm_head`` of it is the target's exact next-token
distribution, so no top-k truncation is needed and the file stays small (one H-vector per layer
and token, float16). Rows are keyed by their token ids; the directory by the target (name,
depth, embedding fingerprint, dtype) and the layer list, so another target or drafter never
reads these states. Files are written atomically; an unreadable one is recomputed, never trusted.
Caches are never committed (``.gitignore``), token ids are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..modeling_angelspec_common import embedding_fingerprint, target_name

logger = logging.getLogger(__name__)

# float16 keeps 11 significant bits (bfloat16: 8); hidden states beyond its range stay float32.
STORE_DTYPE = torch.float16
FLOAT16_LIMIT = 60000.0


def target_identity(target) -> dict:
    """What makes two models' states interchangeable: name, depth, dtype, embedding fingerprint, the
    config (rope_theta and the like change every state) and a sample of every weight tensor. Name and
    embeddings alone let a fine-tune saved over the same path with frozen embeddings read the base
    model's states as its own (every row a cache hit)."""
    text = target.config.get_text_config()
    return {
        "target": target_name(target), "layers": text.num_hidden_layers, "dtype": str(target.dtype),
        "fingerprint": [round(x, 4) for x in embedding_fingerprint(target.get_input_embeddings().weight)],
        "config": config_digest(target.config), "weights": weights_digest(target),
    }


# Config entries that name or describe a copy of a model rather than the function it computes.
VOLATILE_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype", "architectures")


def config_digest(config) -> str:
    fields = {key: value for key, value in config.to_dict().items()
              if not key.startswith("_") and key not in VOLATILE_CONFIG_KEYS}
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weights_digest(target, values: int = 8) -> str:
    """A hash of the first and last ``values`` entries of every parameter and buffer, in float32: any
    fine-tune moves some of them, at the cost of one pass over the parameter list."""
    digest = hashlib.sha1()
    for name, tensor in [*target.named_parameters(), *target.named_buffers()]:
        flat = tensor.detach().flatten()
        sample = torch.cat([flat[:values], flat[-values:]]).float().cpu()
        digest.update(name.encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def digest(identity: dict) -> str:
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def target_key(target, layer_ids: list[int]) -> str:
    """A short name for (target, dtype, layers): the cache's subdirectory."""
    identity = {**target_identity(target), "read_layers": list(layer_ids)}
    name = (identity["target"] or type(target).__name__).replace("/", "--")
    return f"{name}-{digest(identity)}"


# Written into each cache directory, so that a drafter reading fewer layers finds the caches of
# the same target that hold them (directory names are digests).
LAYERS_FILE = "layers.json"


def row_key(token_ids: torch.Tensor) -> str:
    return hashlib.sha1(token_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()


class FeatureCache:
    """Per-row target states (``features``: the drafter's input layers, ``final``: the normed last
    hidden state) under ``directory/<target key>/``.

    A row missing here is also looked up in the caches of the same target that hold more layers
    (a five-layer DFly cache serves a drafter reading three of them), and read from there sliced;
    new rows are stored here only.
    """

    def __init__(self, directory: str | os.PathLike, target, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self.directory = Path(directory) / target_key(target, self.layer_ids)
        self.directory.mkdir(parents=True, exist_ok=True)
        target_digest = digest(target_identity(target))
        layers_file = self.directory / LAYERS_FILE
        if not layers_file.exists():
            layers_file.write_text(json.dumps({"target": target_digest, "read_layers": self.layer_ids}))
        self.supersets = [source for source in self._caches_holding(target_digest) if source[0] != self.directory]
        self.hits = self.misses = 0

    def _caches_holding(self, target_digest: str) -> list[tuple[Path, int, list[int]]]:
        """``(directory, its layer count, positions of this cache's layers in its layer list)`` of
        every cache of this target whose layers include all of this cache's."""
        found = []
        for layers_file in sorted(self.directory.parent.glob(f"*/{LAYERS_FILE}")):
            try:
                info = json.loads(layers_file.read_text())
                held = [int(i) for i in info["read_layers"]]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if info.get("target") == target_digest and set(self.layer_ids) <= set(held):
                found.append((layers_file.parent, len(held), [held.index(i) for i in self.layer_ids]))
        return found

    def _path(self, token_ids: torch.Tensor, directory: Path | None = None) -> Path:
        key = row_key(token_ids)
        return (directory or self.directory) / key[:2] / f"{key}.safetensors"

    def load(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(features (layers, n, H), final (n, H))`` of one row's real tokens, or None."""
        for directory, layers, index in [(self.directory, len(self.layer_ids), None), *self.supersets]:
            path = self._path(token_ids, directory)
            if path.exists():
                return self._read(path, token_ids.numel(), layers, index)
        return None

    def _read(self, path: Path, length: int, layers: int, index: list[int] | None):
        """A file's states, checked against its directory's layer count, sliced to ``index`` if given."""
        try:
            stored = load_file(path)
            features, final = stored["features"], stored["final"]
        except (SafetensorError, KeyError, OSError) as exc:
            logger.warning("Unreadable cached target states %s (%s); recomputing them.", path, exc)
            return None
        if features.shape[1] != length or features.shape[0] != layers:
            logger.warning("Cached target states %s have the wrong shape %s; recomputing them.", path, tuple(features.shape))
            return None
        return (features if index is None else features[index]), final

    def store(self, token_ids: torch.Tensor, features: torch.Tensor, final: torch.Tensor) -> None:
        path = self._path(token_ids)
        path.parent.mkdir(exist_ok=True)
        tensors = {"features": features, "final": final}
        fits = all(t.abs().max().item() < FLOAT16_LIMIT for t in tensors.values())
        tensors = {k: (v.to(STORE_DTYPE) if fits else v.float()).contiguous().cpu() for k, v in tensors.items()}
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        save_file(tensors, partial)
        os.replace(partial, path)  # atomic: concurrent writers (several GPUs) never leave half a file

    def states(self, target, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: torch.Tensor,
               dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Features and final hidden state of a right-padded batch, from disk where cached.

        Positions past a row's length are zero (they are masked out of every loss). The target
        runs on the whole batch when any row is missing, and the missing rows are stored.
        """
        rows = [input_ids[i, : int(lengths[i])] for i in range(input_ids.shape[0])]
        cached = [self.load(row) for row in rows]
        self.hits += sum(c is not None for c in cached)
        self.misses += sum(c is None for c in cached)
        if any(c is None for c in cached):
            features, final = run_target(target, input_ids, attention_mask, self.layer_ids)
            for i, row in enumerate(rows):
                if cached[i] is None:
                    self.store(row, torch.stack([f[i, : row.numel()] for f in features]), final[i, : row.numel()])
            return [f.to(dtype) for f in features], final
        batch, width = input_ids.shape
        stacked = torch.zeros(len(self.layer_ids), batch, width, cached[0][1].shape[-1], dtype=dtype)
        final = torch.zeros(batch, width, cached[0][1].shape[-1], dtype=dtype)
        for i, (row_features, row_final) in enumerate(cached):
            stacked[:, i, : row_final.shape[0]] = row_features.to(dtype)
            final[i, : row_final.shape[0]] = row_final.to(dtype)
        device = input_ids.device
        return [layer.to(device) for layer in stacked.unbind(0)], final.to(device)


def run_target(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               layer_ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The drafter's input layers and the final normed hidden state, from one target forward."""
    # No autocast (mixed-precision training): the drafter must learn from the states inference gives it.
    with torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
        # The base model only: the lm_head is applied later at the label positions alone.
        out = target.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                output_hidden_states=[i + 1 for i in layer_ids])
    return [out.hidden_states[i + 1] for i in layer_ids], out.last_hidden_state
