"""A key/value cache that appends in place: the engine's cache.

transformers' `DynamicLayer` appends a forward's keys and values with ``torch.cat``, which copies
the whole cache of the layer on every forward. In plain batched decoding that copy is most of
what a step does besides the weights: on the reference target at concurrency 16 (2 threads, the
main job's 32 requests, contexts of 100-500 tokens) `DynamicLayer.update` took 4.4 s of a 35.1 s
pass. `BufferedLayer` keeps its keys and values as views of a larger buffer with free columns
after them, writes each forward's columns into those, and copies only when the buffer is full
(into one with a quarter more room, so copies become rare as the cache grows). Attention reads
the same values through a strided view: the same keys, the same sums.

The engine also drops columns no row attends to any more (`keep_columns`): a view again, and
the room before the view is reclaimed at the next copy.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

# A buffer holds what it must plus a quarter more columns, and at least this many: at one column a
# step (plain decoding) a 400-column cache is then copied once in 100 steps instead of every step.
MIN_FREE_COLUMNS = 32
FREE_SHARE = 0.25


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with free columns after them.

    Anything that replaces ``keys``/``values`` with tensors of its own (transformers' ``crop``,
    ``offload``, or a caller assigning them) is honoured: the next ``update`` copies them into a
    fresh buffer, so the layer never writes into memory it does not own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._start = 0  # the buffer column of the views' first column

    def _owns_views(self) -> bool:
        return self._views is not None and self.keys is self._views[0] and self.values is self._views[1]

    def _length(self) -> int:
        return self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0

    def _set_views(self, start: int, length: int) -> None:
        keys, values = self._buffers
        self._start = start
        self.keys, self.values = keys[:, :, start:start + length], values[:, :, start:start + length]
        self._views = (self.keys, self.values)

    def _rebuffer(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """New buffers for ``needed`` columns and free ones, holding the current columns first."""
        length = self._length()
        keys, values = (_new_buffer(states, states.shape[0], needed) for states in (key_states, value_states))
        if length:
            keys[:, :, :length] = self.keys
            values[:, :, :length] = self.values
        self._buffers = (keys, values)
        self._set_views(0, length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self._length(), key_states.shape[-2]
        fits = (self._owns_views() and self._start + length + new <= self._buffers[0].shape[2]
                and self._buffers[0].shape[:2] == key_states.shape[:2])
        if not fits:
            self._rebuffer(key_states, value_states, length + new)
        end = self._start + length
        self._buffers[0][:, :, end:end + new] = key_states
        self._buffers[1][:, :, end:end + new] = value_states
        self._set_views(self._start, length + new)
        return self.keys, self.values

    def stack(self, layers: list[DynamicLayer], length: int) -> None:
        """Hold the rows of ``layers`` (this one may be among them), in order, each left-padded to
        ``length`` columns with zeros: copied once, into buffers with free columns.

        Zeros, not free memory: a padding column is masked, but a masked score is still computed
        from its key, and a NaN there would survive the mask."""
        rows = sum(layer.keys.shape[0] for layer in layers)
        keys, values = (_new_buffer(states, rows, length) for states in (layers[0].keys, layers[0].values))
        row = 0
        for layer in layers:
            count, columns = layer.keys.shape[0], layer.keys.shape[2]
            for buffer, states in ((keys, layer.keys), (values, layer.values)):
                buffer[row:row + count, :, : length - columns].zero_()
                buffer[row:row + count, :, length - columns: length] = states
            row += count
        self._buffers = (keys, values)
        self._set_views(0, length)

    def place(self, row: int, other: DynamicLayer, other_row: int) -> None:
        """Hold ``other``'s row ``other_row`` in row ``row``, left-padded with zeros to this layer's
        columns (``other`` may have no more of them); the row's old contents are overwritten."""
        columns, length = other.keys.shape[2], self._length()
        if columns > length:
            raise ValueError(f"a row of {columns} columns does not fit a layer of {length}")
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            mine[row, :, : length - columns].zero_()
            mine[row, :, length - columns:] = theirs[other_row]

    def keep_columns(self, first: int, last: int) -> None:
        """Keep columns ``first`` to ``last`` (exclusive) only; a view, no copy."""
        if self._owns_views():
            self._set_views(self._start + first, last - first)
        else:
            self.keys, self.values = self.keys[:, :, first:last], self.values[:, :, first:last]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``, copied with the buffer's free columns."""
        if not self._owns_views() or self._length() == 0:
            super().batch_select_indices(indices)
            return
        self._buffers = (self._buffers[0][indices], self._buffers[1][indices])
        self._set_views(self._start, self._length())

    def reset(self) -> None:
        super().reset()
        self._buffers = self._views = None
        self._start = 0


def _new_buffer(like: torch.Tensor, rows: int, needed: int) -> torch.Tensor:
    """An uninitialised buffer of ``rows`` rows shaped like ``like`` with room for ``needed`` columns and free ones."""
    capacity = needed + max(MIN_FREE_COLUMNS, int(needed * FREE_SHARE))
    return like.new_empty(rows, like.shape[1], capacity, like.shape[-1])


class BufferedCache(DynamicCache):
    """A `DynamicCache` of `BufferedLayer` s, created lazily as the target's layers update it."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=BufferedLayer)
