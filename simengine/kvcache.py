"""A finite pool of KV-cache blocks with vLLM-style automatic prefix caching, for the timing model.

Invariant: every block is either held (reference count > 0, by one or more running sequences) or free, never
both. A free block may still carry the hash of the full block it last held; it is then a prefix-cache entry
until it is handed out again, least recently freed first (vLLM's free-block queue). ``usage`` counts held
blocks only, as vLLM's ``kv_cache_usage_perc`` does: cached-but-free blocks cost nothing until evicted.

A block's hash chains its tokens with the hash of the block before it, so two sequences share a cached block
only when they share every token up to its end (a multi-turn rollout's next prompt reuses its last turn).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], block_size: int, n_blocks: int, known: list[int]) -> list[int]:
    """Extend ``known`` (the chain of ``tokens``' first blocks) to ``n_blocks`` hashes and return it."""
    h = known[-1] if known else 0
    for i in range(len(known), n_blocks):
        h = hash((h, tuple(tokens[i * block_size : (i + 1) * block_size])))
        known.append(h)
    return known


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens; a hash -> block map for the cached full blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.queries_total = 0
        """Prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries)."""
        self.hits_total = 0
        """Prompt tokens found there (vllm:prefix_cache_hits)."""

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (0-1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def cached_prefix(self, hashes: Sequence[int], n: int) -> list[int]:
        """Block ids of the longest cached leading run of ``hashes[:n]``; changes nothing."""
        out: list[int] = []
        for i in range(min(n, len(hashes))):
            block = self._cached.get(hashes[i])
            if block is None:
                break
            out.append(block)
        return out

    def can_allocate(self, n: int, touching: Sequence[int] = ()) -> bool:
        """Whether ``n`` new blocks are free once the cached blocks ``touching`` are taken too."""
        taken = sum(1 for b in touching if self._ref[b] == 0)
        return n <= len(self._free) - taken

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free queue."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, evicting the least recently freed; the caller checked `can_allocate`."""
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of[b]
            if h is not None:
                if self._cached.get(h) == b:
                    del self._cached[h]
                self._hash_of[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; the last block goes first, so it is evicted first."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def register(self, block: int, h: int) -> None:
        """Make a held, now full block findable by its hash (unless an identical block already is)."""
        if h not in self._cached and self._hash_of[block] is None:
            self._cached[h] = block
            self._hash_of[block] = h
