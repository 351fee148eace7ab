"""Paged attention, plugged into transformers' models through ``AttentionInterface``.

The model runs one forward per engine step over a flattened ``[1, T]`` batch. Tokens
of single-token queries (decodes) come first, then prefill chunks. Each call writes
the step's keys and values into the paged cache at ``slot_mapping`` and attends:

* decodes, sorted by context length into groups of similar length, one batched call
  per group. On CPU that call is ``paged_decode_attention`` compiled by
  ``torch.compile``: the block lookup is fused into the attention's reductions, so the
  keys and values are read once, in place (about 1.8x faster than copying the blocks
  out first). With ``enforce_eager``, on CUDA, or when compilation fails, the group's
  blocks are gathered into a reused workspace and handed to SDPA;
* each prefill chunk on its own, causally, over its cached prefix plus itself.

A step of decodes only, on the C kernel, does the cache writes and the attention in one
call (``CpuDecodeKernel.decode_step``).

The per-step metadata travels as the ``triollm_metadata`` keyword through an eager
model call, which transformers passes down to every attention layer. A compiled model
(``torch.compile`` traces the modules, not this Python metadata) calls the custom op
``triollm::paged_attention`` instead, which finds the metadata in ``forward_metadata``,
set on the model thread for the length of the forward.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from triollm.model.ops import define_op

__all__ = [
    "ATTENTION_NAME",
    "LAYER_ATTRIBUTE",
    "DecodeGroup",
    "KVCacheSpec",
    "PagedAttentionMetadata",
    "PagedKVCache",
    "PrefillChunk",
    "ProfileRecorder",
    "compiled_paged_decode_attention",
    "forward_metadata",
    "paged_attention",
    "paged_attention_forward",
    "paged_decode_attention",
]

ATTENTION_NAME = "triollm_paged"
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


def _visible_keys(key_positions: torch.Tensor, query_positions: torch.Tensor,
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
            mask = _visible_keys(positions, self.context_lens[:, None] - 1, sliding_window)
            mask = mask[:, None, None, :]
            self._masks[sliding_window] = mask
        return mask


DecodeKernel = Callable[..., torch.Tensor]


@dataclass
class PagedAttentionMetadata:
    kv_cache: PagedKVCache | None
    slot_mapping: torch.Tensor
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    profile: ProfileRecorder | None = None
    #: ``paged_decode_attention``'s signature; None: gather the blocks, then SDPA.
    decode_kernel: DecodeKernel | None = None
    _masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)

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
                self._masks[key] = _visible_keys(key_pos, query_pos, sliding_window)[None, None]
        return self._masks[key]


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``[B, Hq, Lq, D]`` attention over ``[B, Hkv, Lk, D]``; a ``None`` mask means causal."""
    groups = query.shape[1] // key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=groups > 1,
        )
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril(lk - lq)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Single-token queries ``[B, Hq, D]`` over their sequences' blocks, read in place.

    ``block_tables`` is ``[B, max_blocks]`` (padded with any valid block id) and
    ``context_lens`` ``[B]``. Written so that ``torch.compile`` fuses the block lookup
    into the two reductions; run eagerly it is correct but materialises the lookups."""
    batch, max_blocks = block_tables.shape
    kv_heads, _, block_size, dim = key_cache.shape
    groups = query.shape[1] // kv_heads
    length = max_blocks * block_size
    q = query.reshape(batch, kv_heads, groups, dim).permute(1, 0, 2, 3)  # [Hkv, B, G, D]
    keys = key_cache[:, block_tables]  # [Hkv, B, max_blocks, block_size, D]
    scores = (q[:, :, :, None, None, :] * keys[:, :, None]).sum(-1)
    scores = scores.reshape(kv_heads, batch, groups, length) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(length, device=query.device)[None, :]
    visible = _visible_keys(positions, context_lens[:, None] - 1, sliding_window)
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).reshape(
        kv_heads, batch, groups, max_blocks, block_size, 1)
    values = value_cache[:, block_tables][:, :, None]  # [Hkv, B, 1, max_blocks, bs, D]
    out = (weights * values).sum(dim=(3, 4))  # [Hkv, B, G, D]
    return out.permute(1, 0, 2, 3).reshape(batch, kv_heads * groups, dim)


@functools.cache
def _compiled_decode() -> DecodeKernel:
    return torch.compile(paged_decode_attention, dynamic=True)


def compiled_paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """``paged_decode_attention`` through ``torch.compile`` (one process-wide compiled
    function, dynamic in batch and table width)."""
    query = query.contiguous()  # its strides vary with the step's size: a guard each
    batch, max_blocks = block_tables.shape
    if batch < 2 or max_blocks < 2:
        # Sizes 0 and 1 are specialised by torch.compile and would each cost a compile;
        # pad to 2 with a harmless extra row (context 1) or table column (masked out).
        rows, columns = max(batch, 2), max(max_blocks, 2)
        tables = block_tables.new_zeros(rows, columns)
        tables[:batch, :max_blocks] = block_tables
        lens = context_lens.new_ones(rows)
        lens[:batch] = context_lens
        padded = query.new_zeros(rows, *query.shape[1:])
        padded[:batch] = query
        query, block_tables, context_lens = padded, tables, lens
    return _compiled_decode()(query, key_cache, value_cache, block_tables, context_lens,
                              scale, sliding_window, softcap)[:batch]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    triollm_metadata: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: ``[1, H, T, D]`` in, ``[1, T, H, D]`` out."""
    if query.shape[0] != 1:
        raise RuntimeError("triollm runs one flattened [1, T] batch per forward")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(sliding_window, int) and sliding_window <= 0:
        sliding_window = None
    if torch.compiler.is_compiling():
        out = paged_attention(query[0], key[0], value[0], getattr(module, LAYER_ATTRIBUTE),
                              scale, sliding_window, softcap)
        return out.transpose(0, 1).unsqueeze(0), None
    meta = triollm_metadata
    if meta is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention runs only inside triollm's model runner")
    q, k, v = query[0], key[0], value[0]  # [H, T, D]

    if meta.profile is not None:
        meta.profile.layers[id(module)] = KVCacheSpec(k.shape[0], k.shape[-1])
        out = _attend(q[None], k[None], v[None], None, scale, softcap)
        return out.transpose(1, 2), None

    if meta.kv_cache is None:
        raise RuntimeError("paged attention called without a KV cache")
    key_cache, value_cache = meta.kv_cache.layer(module)
    out = _paged_attention(meta, key_cache, value_cache, q, k, v, scale, sliding_window, softcap)
    return out.transpose(0, 1).unsqueeze(0), None


def _paged_attention(
    meta: PagedAttentionMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Write the step's keys and values into one layer's cache and attend: ``[H, T, D]``
    in, ``[Hq, T, D]`` out in the query's dtype."""
    assert meta.kv_cache is not None
    decode_step = getattr(meta.decode_kernel, "decode_step", None)
    if decode_step is not None and not meta.prefills and len(meta.decode_groups) == 1:
        # A step of decodes only: the cache writes and the attention in one call
        # (cpu_decode.py's C kernel; it returns None for inputs it does not take).
        group = meta.decode_groups[0]
        out = decode_step(q, k, v, meta.slot_mapping, key_cache, value_cache,
                          group.block_tables, group.context_lens, scale, sliding_window,
                          softcap)
        if out is not None:
            return out
    heads, _, _, dim = key_cache.shape
    # Attention computes in fp32 on CPU (where SDPA is ~3x faster than in bf16), else
    # in the cache's dtype; the cache may be narrower (bf16 on CPU, read by the C
    # decode kernel); the result goes back to the model's dtype.
    model_dtype = q.dtype
    compute = torch.float32 if key_cache.device.type == "cpu" else key_cache.dtype
    key_cache.view(heads, -1, dim).index_copy_(1, meta.slot_mapping, k.to(key_cache.dtype))
    value_cache.view(heads, -1, dim).index_copy_(1, meta.slot_mapping, v.to(key_cache.dtype))
    q = q.to(compute)  # keys and values are converted only where a prefill reads them

    out = torch.empty_like(q)
    block_size = key_cache.shape[2]
    for group in meta.decode_groups:
        if meta.decode_kernel is not None:
            out[:, group.start:group.end] = meta.decode_kernel(
                q[:, group.start:group.end].transpose(0, 1), key_cache, value_cache,
                group.block_tables, group.context_lens, scale, sliding_window, softcap,
            ).transpose(0, 1)
            continue
        batch, max_blocks = group.block_tables.shape
        flat = group.block_tables.reshape(-1)
        length = max_blocks * block_size
        gathered_k = meta.kv_cache.gather(key_cache, flat, "k").view(
            heads, batch, length, dim).to(compute)
        gathered_v = meta.kv_cache.gather(value_cache, flat, "v").view(
            heads, batch, length, dim).to(compute)
        decode_q = q[:, group.start:group.end].transpose(0, 1).unsqueeze(2)  # [B, Hq, 1, D]
        decode_out = _attend(decode_q, gathered_k.transpose(0, 1), gathered_v.transpose(0, 1),
                             group.mask(sliding_window, block_size), scale, softcap)
        out[:, group.start:group.end] = decode_out[:, :, 0].transpose(0, 1)
    for index, chunk in enumerate(meta.prefills):
        chunk_q = q[:, chunk.query_start:chunk.query_end]
        if chunk.context_len == chunk.num_query:
            chunk_k = k[:, chunk.query_start:chunk.query_end].to(compute)
            chunk_v = v[:, chunk.query_start:chunk.query_end].to(compute)
        else:
            chunk_k = key_cache[:, chunk.block_ids].view(heads, -1, dim)[
                :, : chunk.context_len].to(compute)
            chunk_v = value_cache[:, chunk.block_ids].view(heads, -1, dim)[
                :, : chunk.context_len].to(compute)
        mask = meta.prefill_mask(index, sliding_window)
        chunk_out = _attend(chunk_q[None], chunk_k[None], chunk_v[None], mask, scale, softcap)
        out[:, chunk.query_start:chunk.query_end] = chunk_out[0]
    return out.to(model_dtype)


_forward = threading.local()


@contextlib.contextmanager
def forward_metadata(metadata: PagedAttentionMetadata) -> Iterator[None]:
    """The step's metadata for a compiled forward, which cannot take it as a keyword:
    ``paged_attention`` (the custom op) reads it on this thread while the forward runs."""
    _forward.metadata = metadata
    try:
        yield
    finally:
        _forward.metadata = None


def _paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    meta: PagedAttentionMetadata | None = getattr(_forward, "metadata", None)
    if meta is None or meta.kv_cache is None:
        raise RuntimeError("triollm::paged_attention called outside forward_metadata")
    return _paged_attention(meta, meta.kv_cache.keys[layer], meta.kv_cache.values[layer],
                            query, key, value, scale, sliding_window, softcap)


def _paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          layer: int, scale: float, sliding_window: int | None,
                          softcap: float | None) -> torch.Tensor:
    return torch.empty_like(query)


#: The paged attention of the KV cache's layer ``layer`` as one opaque op, for a compiled
#: model (``torch.compile`` cannot trace the step's Python metadata): ``[H, T, D]`` in,
#: ``[Hq, T, D]`` out. It writes the layer's cache, which is not an argument: the cache
#: is the runner's, found through ``forward_metadata``.
paged_attention = define_op(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
    "int? sliding_window, float? softcap) -> Tensor", _paged_attention_op,
    _paged_attention_fake)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
