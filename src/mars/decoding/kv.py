"""A per-row ("ragged") KV cache for multi-token decoding with rows of different lengths.

Every layer holds one buffer ``[batch, kv_heads, capacity, head_dim]``; row ``b`` keeps its committed
tokens at buffer positions ``0 .. start[b]-1`` (no left padding, so a row's buffer position is also its
RoPE position).  Before each forward the engine tells the cache where every column of the step's input
goes (``write_positions[b, i] = start[b] + i``); ``update`` scatters the new keys/values there and
returns the buffer up to ``kv_length``.  The engine passes a 4D boolean mask (True = attend) that is
causal in buffer positions, which is all the masking a row needs: keys below ``start[b]`` are its
committed tokens, keys from there up to the query are this step's columns of the same row.  Columns
past the real tokens (drafts, masks, padding) land in the row's free space and are overwritten later,
so "committing" a step's real tokens is just advancing ``start[b]`` — the masks' K/V are never copied.

Rows join (:meth:`RaggedKVCache.add_rows`, zero buffers) and leave (:meth:`RaggedKVCache.select_rows`)
between steps, and the capacity grows on demand, so the engine can batch continuously.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class RaggedKVLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: RaggedKVCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        cap = self.owner.capacity
        self.keys = key_states.new_zeros((batch, heads, cap, key_states.shape[-1]))
        self.values = value_states.new_zeros((batch, heads, cap, value_states.shape[-1]))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.shape[2] < self.owner.capacity:
            self._pad_positions(self.owner.capacity)
        start = self.owner.single_row_start
        if start is not None and self.keys.shape[0] == 1:  # one row writing one run of positions: a copy
            q = key_states.shape[2]
            self.keys[:, :, start : start + q].copy_(key_states)
            self.values[:, :, start : start + q].copy_(value_states)
        else:
            pos = self.owner.write_positions  # [batch, q]
            self.keys.scatter_(2, pos[:, None, :, None].expand_as(key_states), key_states)
            self.values.scatter_(2, pos[:, None, :, None].expand_as(value_states), value_states)
        n = self.owner.kv_length
        return self.keys[:, :, :n], self.values[:, :, :n]

    def _pad_positions(self, capacity: int) -> None:
        extra = capacity - self.keys.shape[2]
        pad = (0, 0, 0, extra)
        self.keys = torch.nn.functional.pad(self.keys, pad)
        self.values = torch.nn.functional.pad(self.values, pad)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_length, 0

    def get_seq_length(self) -> int:
        return self.owner.kv_length

    def get_max_length(self) -> int:
        return self.owner.capacity

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys = self.keys.index_select(0, rows)
            self.values = self.values.index_select(0, rows)

    def extend(self, other: RaggedKVLayer, rows: int, other_rows: int) -> None:
        """Append ``other``'s ``other_rows`` rows after this layer's ``rows`` (a side whose rows never ran a
        forward has no buffers yet: it gets zeros, which no row reads before writing them)."""
        if not other.is_initialized and not self.is_initialized:
            return
        if not self.is_initialized:
            self.keys = other.keys.new_zeros((rows, *other.keys.shape[1:]))
            self.values = other.values.new_zeros((rows, *other.values.shape[1:]))
            self.dtype, self.device, self.is_initialized = other.dtype, other.device, True
        keys, values = other.keys, other.values
        if not other.is_initialized:
            keys = self.keys.new_zeros((other_rows, *self.keys.shape[1:]))
            values = self.values.new_zeros((other_rows, *self.values.shape[1:]))
        width = max(self.keys.shape[2], keys.shape[2])
        if self.keys.shape[2] < width:
            self._pad_positions(width)
        if keys.shape[2] < width:
            pad = (0, 0, 0, width - keys.shape[2])
            keys, values = torch.nn.functional.pad(keys, pad), torch.nn.functional.pad(values, pad)
        self.keys = torch.cat([self.keys, keys])
        self.values = torch.cat([self.values, values])

    def add_rows(self, count: int) -> None:
        if self.is_initialized:
            shape = (count, *self.keys.shape[1:])
            self.keys = torch.cat([self.keys, self.keys.new_zeros(shape)])
            self.values = torch.cat([self.values, self.values.new_zeros(shape)])


class RaggedKVCache(Cache):
    """Per-layer buffers with per-row lengths; see the module docstring."""

    def __init__(self, num_layers: int, capacity: int = 64):
        self.capacity = int(capacity)
        self.write_positions: torch.Tensor | None = None
        self.single_row_start: int | None = None
        self.kv_length = 0
        self.rows = 0  # rows held (their buffers exist once a forward has run)
        super().__init__(layers=[RaggedKVLayer(self) for _ in range(num_layers)])

    def prepare_step(self, write_positions: torch.Tensor, kv_length: int) -> None:
        """Where this step's input columns go, and how much of the buffer the attention reads
        (the buffers grow, by half again at least, when a step reaches past their capacity)."""
        if kv_length > self.capacity:
            self.capacity = max(int(kv_length), int(self.capacity * 1.5))
        self.write_positions = write_positions
        self.kv_length = int(kv_length)
        # A single CPU row writing consecutive positions (every decode step at batch 1): each layer copies
        # a slice instead of scattering (a scatter with an expanded index costs ~10x a copy here).
        self.single_row_start = None
        if write_positions.shape[0] == 1 and write_positions.device.type == "cpu":
            row = write_positions[0]
            start = int(row[0])
            if bool((row == torch.arange(start, start + row.numel())).all()):
                self.single_row_start = start

    def step_buffers(self, like: torch.Tensor, heads: int, head_dim: int) -> tuple[list, list]:
        """Every layer's key and value buffers at the current capacity (created from ``like``'s batch, dtype and
        device, or grown, first), for a forward that writes this step's columns itself instead of calling
        ``update`` (the C++ layer loop of :class:`mars.decoding.lean.LeanDecoder`)."""
        empty = like.new_empty((like.shape[0], heads, 0, head_dim))
        for layer in self.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(empty, empty)
            elif layer.keys.shape[2] < self.capacity:
                layer._pad_positions(self.capacity)
        return [layer.keys for layer in self.layers], [layer.values for layer in self.layers]

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy every layer's keys/values at buffer positions ``source`` ``[batch, n]`` to ``target`` (the accepted
        path of a tree step moves down to the slots after the committed text; a position copied onto itself is a
        no-op).  All sources are read before any target is written."""
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            for name in ("keys", "values"):
                buffer = getattr(layer, name)
                shape = (-1, buffer.shape[1], source.shape[1], buffer.shape[3])
                moved = buffer.gather(2, source[:, None, :, None].expand(shape))
                buffer.scatter_(2, target[:, None, :, None].expand(shape), moved)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (drop finished ones from the batch)."""
        self.rows = len(rows)
        for layer in self.layers:
            layer.select_rows(rows)

    def extend(self, other: RaggedKVCache) -> None:
        """Append ``other``'s rows (a group prefilled on its own joins the running batch)."""
        self.capacity = max(self.capacity, other.capacity)
        for mine, theirs in zip(self.layers, other.layers):
            mine.extend(theirs, self.rows, other.rows)
        self.rows += other.rows

    def add_rows(self, count: int) -> None:
        """Append ``count`` empty rows (requests joining the running batch)."""
        self.rows += count
        for layer in self.layers:
            layer.add_rows(count)
