"""A slot-based KV cache: one preallocated tensor per layer, one slot per running sequence.

Running sequences occupy slots ``0..n-1`` with no holes, so a decode step attends over the plain view
``k[:n, :, :L]`` (no gather). When a sequence finishes, a sequence from the tail moves into its slot
(``copy_prefix``; the finished one's cache moves first to a free slot beyond ``n``, parked for reuse by a later
prompt that extends it; ``engine.prefix_cache.SlotTable``).
Capacity grows by reallocation, so memory follows the workload instead of ``max_position_embeddings``;
each growth copies the whole cache and page-faults the new one in, hence geometric steps. Memory is
slots x capacity x layers x 2 x kv_heads x head_dim x dtype size (4 KB per token-slot for the tiny model).
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, torch.device(device)
        # One tensor holds every layer's keys and values, [2 · layers, slots, kv_heads, capacity, head_dim]:
        # moving a slot is then one copy for all layers, not one per layer and per k/v.
        self.store = torch.zeros(0, dtype=dtype, device=self.device)
        self.k: list[torch.Tensor] = []  # per layer [slots, kv_heads, capacity, head_dim], views of ``store``
        self.v: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [slots] tokens cached per slot
        self._alloc(0, 0)

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def _alloc(self, slots: int, length: int) -> None:
        old, old_len = self.store, self.lengths
        shape = (2 * self.num_layers, slots, self.num_kv_heads, length, self.head_dim)
        self.store = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k = [self.store[i] for i in range(self.num_layers)]
        self.v = [self.store[self.num_layers + i] for i in range(self.num_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long, device=self.device)
        if old.numel():
            s, n = old_len.shape[0], old.shape[3]
            self.store[:, :s, :, :n] = old
            self.lengths[:s] = old_len

    def reserve(self, slots: int, length: int) -> None:
        """Make room for ``slots`` sequences of up to ``length`` tokens each."""
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the model's {self.max_len} positions")
        if slots <= self.num_slots and length <= self.capacity:
            return
        new_slots = self.num_slots if slots <= self.num_slots else max(slots, 2 * self.num_slots, 8)
        new_len = self.capacity
        if length > new_len:  # x1.5 in multiples of 64: fewer regrowths, less waste than doubling
            new_len = min(self.max_len, -(-max(length, new_len * 3 // 2, 64) // 64) * 64)
        self._alloc(new_slots, new_len)

    def token_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where tokens (``slots[j]``, ``positions[j]``) live in a layer's [slots · kv_heads · capacity, head_dim]
        row view, [n · kv_heads] (token-major, heads inner: the order of a [n, kv_heads, head_dim] tensor).
        Valid until the cache next grows (``reserve``)."""
        heads = torch.arange(self.num_kv_heads, device=self.device)
        return ((slots[:, None] * self.num_kv_heads + heads) * self.capacity + positions[:, None]).reshape(-1)

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the keys and values ``k``, ``v`` [n, kv_heads, head_dim] of the tokens ``index`` names (from
        ``token_index``). One row copy per token and head: advanced-index assignment into the 4-d cache
        (``k[slots, :, positions] = ...``) measured about 10× slower on a CPU (a general index_put)."""
        d = self.head_dim
        self.k[layer].view(-1, d).index_copy_(0, index, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, index, v.reshape(-1, d))

    def copy_prefix(self, src: int, dst: int, n: int, keep: int = 0) -> None:
        """Make slot ``dst`` hold the first ``n`` cached tokens of slot ``src``, of which it holds the first ``keep``
        already (copied are positions ``keep..n-1``)."""
        self.reserve(dst + 1, n)
        self.store[:, dst, :, keep:n] = self.store[:, src, :, keep:n]
        self.lengths[dst] = n
