"""Paged KV-cache blocks: a free queue, reference counts, per-request block tables and,
with prefix caching, a map from block contents to the block that holds them.

Block ids index the runner's KV tensors; this module never touches them. A block is
referenced by every request whose table holds it and returns to the free queue when its
count drops to zero.

Automatic prefix caching (``enable_prefix_caching``): a block full of computed tokens
is identified by a chained hash, ``sha256(parent's hash + its token ids)``, so one hash
names a whole prefix. A new request reuses every cached block of its longest cached
prefix. A freed block keeps its contents and its hash while it waits in the free queue
(it still counts as free); the queue is in eviction order (least recently freed first,
a request's tail blocks before its head), and a block handed out again loses its hash
then.

The hash is SHA-256 because a hit hands one request the KV another computed: with a
weak hash, a crafted prompt could collide with another user's prefix and read their
KV (vLLM's advisory GHSA-rm76-4mrf-v9r8; vLLM uses SHA-256 since 0.10.2). A request's
``cache_salt`` starts its chain from a root of its own, so only requests with the same
salt share blocks (a tenant can opt out of sharing). So does a request's LoRA adapter
(its id, and the version of its weights): two adapters, or the base model and an
adapter, never share KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["AdapterKey", "BlockManager", "BlockManagerStatistics"]


@dataclass(frozen=True)
class BlockManagerStatistics:
    num_blocks: int
    num_free_blocks: int
    num_requests: int
    num_cached_blocks: int = 0
    #: Prompt tokens looked up in the prefix cache, and how many were found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


#: A LoRA adapter's id and the version of its weights (bumped when they are reloaded).
AdapterKey = tuple[int, int]


def _chain_root(salt: str | None, adapter: AdapterKey | None) -> bytes:
    """Where a request's chain of block hashes starts: a root of its own for a salt or
    an adapter, if it has either."""
    if salt is None and adapter is None:
        return b""
    # repr of a (str | None, tuple | None) pair is unambiguous (the string is quoted)
    return hashlib.sha256(b"triollm prefix root\0" + repr((salt, adapter)).encode()).digest()


def _chain_hash(parent: bytes, block_token_ids: list[int]) -> bytes:
    """The hash naming a full block together with everything before it."""
    return hashlib.sha256(parent + array("q", block_token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *,
                 enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._cached: dict[bytes, int] = {}  # prefix hash -> block
        self._block_hash: dict[int, bytes] = {}  # block -> prefix hash
        self._request_hashes: dict[str, list[bytes]] = {}  # hashes of a request's full blocks
        self._queries = 0
        self._hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        return max(0, self.blocks_for(num_total_tokens) - len(self.block_table(request_id)))

    def can_allocate(self, request_id: str, num_total_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_total_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's table to hold ``num_total_tokens``; False if blocks are short
        (nothing is allocated then)."""
        needed = self.num_new_blocks_needed(request_id, num_total_tokens)
        if needed > len(self._free):
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(needed):
            block = self._take_free()
            self._ref_counts[block] += 1
            table.append(block)
        return True

    def free(self, request_id: str) -> None:
        """Release every block the request holds (no-op for an unknown request). Blocks
        go to the back of the free queue tail first, so a prefix outlives its suffix."""
        self._request_hashes.pop(request_id, None)
        for block in reversed(self._tables.pop(request_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past those ``num_tokens`` tokens need (a speculative
        step's rejected positions). Their contents were never computed tokens, so no
        freed block is hashed."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            block = table.pop()
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        prefix_hash = self._block_hash.pop(block, None)
        if prefix_hash is not None:
            del self._cached[prefix_hash]  # evicted: its contents will be overwritten
        return block

    # -- prefix caching ----------------------------------------------------------------

    def attach_cached_prefix(self, request_id: str, token_ids: list[int], *,
                             salt: str | None = None, adapter: AdapterKey | None = None
                             ) -> int:
        """Give a request that holds no blocks the cached blocks of its longest cached
        prefix; returns how many tokens they cover (always fewer than ``token_ids``, so
        at least the last token is computed)."""
        if not self.enable_prefix_caching or self._tables.get(request_id):
            return 0
        size = self.block_size
        hashes: list[bytes] = []
        blocks: list[int] = []
        parent = _chain_root(salt, adapter)
        # A full hit would leave nothing to compute: look at one token fewer.
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            parent = _chain_hash(parent, token_ids[start:start + size])
            block = self._cached.get(parent)
            if block is None:
                break
            hashes.append(parent)
            blocks.append(block)
        self._queries += len(token_ids)
        self._hits += len(blocks) * size
        if not blocks:
            return 0
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        self._tables[request_id] = blocks
        self._request_hashes[request_id] = hashes
        return len(blocks) * size

    def cache_full_blocks(self, request_id: str, token_ids: list[int],
                          num_computed_tokens: int, *, salt: str | None = None,
                          adapter: AdapterKey | None = None) -> None:
        """Record the blocks that ``num_computed_tokens`` computed tokens now fill."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        hashes = self._request_hashes.setdefault(request_id, [])
        size = self.block_size
        full = min(num_computed_tokens // size, len(table))
        while len(hashes) < full:
            index = len(hashes)
            parent = hashes[-1] if hashes else _chain_root(salt, adapter)
            prefix_hash = _chain_hash(parent, token_ids[index * size:(index + 1) * size])
            hashes.append(prefix_hash)
            block = table[index]
            if prefix_hash not in self._cached and block not in self._block_hash:
                self._cached[prefix_hash] = block
                self._block_hash[block] = prefix_hash

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Only while no request holds a block (as vLLM);
        returns whether it did."""
        if self._tables:
            return False
        self._cached.clear()
        self._block_hash.clear()
        return True

    def statistics(self) -> BlockManagerStatistics:
        return BlockManagerStatistics(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_requests=len(self._tables),
            num_cached_blocks=len(self._cached),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def check_invariants(self) -> None:
        """Reference counts match the tables, free blocks are unreferenced, the cache maps
        are each other's inverse (for tests)."""
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                counts[block] += 1
        if counts != self._ref_counts:
            raise AssertionError("reference counts do not match the block tables")
        for block in range(self.num_blocks):
            if (block in self._free) != (counts[block] == 0):
                raise AssertionError(f"block {block} is free and referenced, or neither")
        if {b: h for h, b in self._cached.items()} != self._block_hash:
            raise AssertionError("the prefix cache maps disagree")
