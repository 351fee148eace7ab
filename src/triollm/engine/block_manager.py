"""Paged KV-cache blocks: a free list, reference counts and per-request block tables.

Block ids index the runner's KV tensors; this module never touches them. A block is
referenced by every request whose table holds it and returns to the free list when
its count drops to zero.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["BlockManager", "BlockManagerStatistics"]


@dataclass(frozen=True)
class BlockManagerStatistics:
    num_blocks: int
    num_free_blocks: int
    num_requests: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

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
            block = self._free.popleft()
            self._ref_counts[block] += 1
            table.append(block)
        return True

    def free(self, request_id: str) -> None:
        """Release every block the request holds (no-op for an unknown request)."""
        for block in reversed(self._tables.pop(request_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def statistics(self) -> BlockManagerStatistics:
        return BlockManagerStatistics(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_requests=len(self._tables),
        )
