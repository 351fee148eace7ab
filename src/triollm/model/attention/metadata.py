"""The paged KV cache and the per-step metadata the paged attention reads.

The model runs one forward per engine step over a flattened ``[1, T]`` batch: single-
token queries (decodes) first, sorted by context length into groups of similar length
(``DecodeGroup``), then prefill chunks (``PrefillChunk``), each with the slots its keys
and values are written to. ``PagedAttentionMetadata`` carries all of it to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from triollm.model.attention.kernel import DecodeKernel, DecodeStep

__all__ = [
    "LAYER_ATTRIBUTE",
    "DecodeGroup",
    "KVCacheSpec",
    "PagedAttentionMetadata",
    "PagedKVCache",
    "PrefillChunk",
    "ProfileRecorder",
    "visible_keys",
]

#: Set on each attention module once the KV cache exists: its layer's index in the cache.
LAYER_ATTRIBUTE = "triollm_kv_layer"


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one attention layer's keys and values."""

    num_kv_heads: int
    head_dim: int


@dataclass
class ProfileRecorder:
    """Used for the first forward: finds the attention layers and their KV shapes."""

    layers: dict[int, KVCacheSpec] = field(default_factory=dict)


class PagedKVCache:
    """Per layer, keys and values laid out ``[num_kv_heads, num_blocks, block_size, head_dim]``.

    The layout lets a gather of whole blocks along dim 1 be viewed directly as the
    ``[batch, heads, tokens, head_dim]`` SDPA wants, with no transpose copy.
    """

    def __init__(self, specs: dict[int, KVCacheSpec], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._layer_of_module = {module_id: i for i, module_id in enumerate(specs)}
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for spec in specs.values():
            shape = (spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
        self._workspace: dict[str, torch.Tensor] = {}

    @staticmethod
    def bytes_per_block(specs: dict[int, KVCacheSpec], block_size: int,
                        dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return sum(2 * s.num_kv_heads * s.head_dim * block_size * element for s in specs.values())

    def layer(self, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._layer_of_module[id(module)]
        return self.keys[index], self.values[index]

    def number_layers(self, model: torch.nn.Module) -> None:
        """Tell each of ``model``'s attention modules its layer's index in this cache
        (``LAYER_ATTRIBUTE``): a compiled forward reads it as a constant."""
        for module in model.modules():
            index = self._layer_of_module.get(id(module))
            if index is not None:
                setattr(module, LAYER_ATTRIBUTE, index)

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor, name: str) -> torch.Tensor:
        """``cache[:, block_ids]`` into a reused buffer: ``[heads, len(block_ids), bs, dim]``."""
        heads, _, block_size, dim = cache.shape
        numel = heads * block_ids.numel() * block_size * dim
        buffer = self._workspace.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype:
            buffer = torch.empty(numel, dtype=cache.dtype, device=cache.device)
            self._workspace[name] = buffer
        out = buffer[:numel].view(heads, block_ids.numel(), block_size, dim)
        torch.index_select(cache, 1, block_ids, out=out)
        return out


@dataclass
class PrefillChunk:
    """A multi-token query: tokens ``[query_start, query_end)`` of the flat batch, which
    sit at positions ``context_len - num_query ... context_len - 1`` of its sequence."""

    query_start: int
    query_end: int
    context_len: int
    block_ids: torch.Tensor

    @property
    def num_query(self) -> int:
        return self.query_end - self.query_start


def visible_keys(key_positions: torch.Tensor, query_positions: torch.Tensor,
                 sliding_window: int | None) -> torch.Tensor:
    """Which keys a query may attend to (broadcast): none after it and, with a sliding
    window, only the ``sliding_window`` latest, itself included."""
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible = visible & (key_positions > query_positions - sliding_window)
    return visible


@dataclass
class DecodeGroup:
    """Single-token queries ``[start, end)`` of the flat batch whose contexts are of
    similar length, so that padding them to the longest wastes little."""

    start: int
    end: int
    #: ``[n, max_blocks]`` block ids, padded with block 0 past each table's end.
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None, block_size: int) -> torch.Tensor:
        mask = self._masks.get(sliding_window)
        if mask is None:
            length = self.block_tables.shape[1] * block_size
            positions = torch.arange(length, device=self.block_tables.device)[None, :]
            mask = visible_keys(positions, self.context_lens[:, None] - 1, sliding_window)
            mask = mask[:, None, None, :]
            self._masks[sliding_window] = mask
        return mask



@dataclass
class PagedAttentionMetadata:
    kv_cache: PagedKVCache | None
    slot_mapping: torch.Tensor
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    profile: ProfileRecorder | None = None
    #: The decode attention; None: gather the blocks, then SDPA.
    decode_kernel: DecodeKernel | None = None
    #: The decode kernel's one-call step, where it has one: taken for a step of
    #: decodes only, in one group.
    decode_step: DecodeStep | None = None
    _masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)

    def one_call_group(self) -> DecodeGroup | None:
        """The step's decode group where ``decode_step`` takes the step (decodes only, in
        one group), else None."""
        if self.decode_step is None or self.prefills or len(self.decode_groups) != 1:
            return None
        return self.decode_groups[0]

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """``None`` means plain causal attention over exactly the chunk's own tokens."""
        key = (index, sliding_window)
        if key not in self._masks:
            chunk = self.prefills[index]
            if chunk.context_len == chunk.num_query and sliding_window is None:
                self._masks[key] = None
            else:
                device = self.slot_mapping.device
                query_pos = torch.arange(chunk.context_len - chunk.num_query, chunk.context_len,
                                         device=device)[:, None]
                key_pos = torch.arange(chunk.context_len, device=device)[None, :]
                self._masks[key] = visible_keys(key_pos, query_pos, sliding_window)[None, None]
        return self._masks[key]
