"""The torch model runner: one forward per engine step over a flattened batch.

It owns the transformers model, the paged KV cache and the per-request sampling state
(seeded generators, token history for penalties). It prepares the step's inputs from a
``SchedulerOutput``: single-token queries first, then prefill chunks, with positions
restarting per sequence, a slot for every token and ``logits_to_keep`` so the LM head
only runs where a token is sampled or a prompt log-probability is wanted.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from triollm.config import EngineConfig
from triollm.model.attention.paged import (
    ATTENTION_NAME,
    DecodeGroup,
    DecodeKernel,
    KVCacheSpec,
    PagedAttentionMetadata,
    PagedKVCache,
    PrefillChunk,
    ProfileRecorder,
    compiled_paged_decode_attention,
    forward_metadata,
)
from triollm.model.cpu.decode import CpuDecodeKernel, load_kernel
from triollm.model.cpu.helpers import drain_pools
from triollm.model.cpu.packed_linear import (
    fuse_shared_input_calls,
    group_weights_of_shared_inputs,
    recording_calls,
)
from triollm.model.cpu.threads import ComputeThreads, prepare_for_cpu
from triollm.model.loader import load_model
from triollm.model.lora.manager import LoRAManager
from triollm.model.sampler import SamplingRow, sample, token_logprobs
from triollm.step import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs

if TYPE_CHECKING:
    from triollm.lora.request import LoRARequest

__all__ = ["TorchModelRunner", "decode_spans"]

logger = logging.getLogger(__name__)

_PROFILE_TOKENS = 8
#: A decode joins a group if the group's longest block table is at most this many
#: times its own.
_MAX_DECODE_PADDING = 1.25
#: With the compiled kernel, which reads blocks in place, a call costs about as much as
#: a few hundred keys of padding, so a decode also joins a group when padding it adds
#: at most this many keys. (Few decodes of mixed lengths: one call instead of 3-4,
#: about 1.5-2.5x faster attention; ``benchmarks/decode_attention.py --mixed``.)
_KERNEL_PADDING_KEYS = 512


def _inductor_with_shared_input_calls_fused(graph_module: torch.fx.GraphModule,
                                             example_inputs: list[torch.Tensor]) -> Any:
    """torch.compile's inductor backend, after fusing the calls of linear layers grouped
    on one input (packed_linear.py)."""
    from torch._inductor.compile_fx import compile_fx

    if fuse_shared_input_calls(graph_module.graph):
        graph_module.recompile()
    return compile_fx(graph_module, example_inputs)


def decode_spans(widths: list[int], padding_blocks: int) -> list[tuple[int, int]]:
    """Split decodes, sorted by block-table width longest first, into ``[start, end)``
    groups: a decode joins the group if padding it to the group's width adds at most a
    quarter (``_MAX_DECODE_PADDING``) or at most ``padding_blocks`` blocks."""
    spans = []
    start = 0
    while start < len(widths):
        width = widths[start]
        end = start + 1
        while end < len(widths) and (widths[end] * _MAX_DECODE_PADDING >= width
                                     or width - widths[end] <= padding_blocks):
            end += 1
        spans.append((start, end))
        start = end
    return spans


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


class TorchModelRunner:
    """Runs a transformers causal LM with triollm's paged attention."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model
        self.device = model_config.device
        self.dtype = model_config.dtype
        # Kernels run asynchronously on CUDA: the forward's time is known only after a
        # synchronization, paid only when a trace asks for it.
        self.sync_forward_time = (self.device.type == "cuda" and "model" in
                                  config.observability.collect_detailed_traces)
        # On CPU attention computes in fp32 (the CPU SDPA kernels run several times
        # faster in fp32 than in bf16). The cache keeps the model's dtype where the C
        # decode kernel reads it (bf16 keys and values lose nothing stored as bf16, and
        # take half the memory); without that kernel, decode gathers blocks for SDPA,
        # so the cache is fp32 too.
        self.cpu_kernel = (load_kernel() if self.device.type == "cpu"
                           and not model_config.enforce_eager else None)
        self.cache_dtype = (torch.float32 if self.device.type == "cpu"
                            and self.cpu_kernel is None else self.dtype)
        self.block_size = config.cache.block_size
        self.model = load_model(
            model_config.model,
            model_config.hf_config,
            attn_implementation=ATTENTION_NAME,
            dtype=self.dtype,
            device=self.device,
            trust_remote_code=model_config.trust_remote_code,
            revision=model_config.revision,
            download_dir=model_config.download_dir,
        )
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.compute_threads: ComputeThreads | None = (
            prepare_for_cpu(self.model, model_config.cpu_threads)
            if self.device.type == "cpu" else None)
        self.lora = (LoRAManager(self.model, config.lora, self.device)
                     if config.lora is not None else None)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(model_config.seed)
        self._requests: dict[str, _RequestState] = {}
        # the profile forward also shows which layers read the same input (LoRA groups)
        specs = self.lora.calibrate(self._profile) if self.lora is not None else self._profile()
        self.num_kv_blocks = self._num_blocks(specs)
        self.kv_cache = PagedKVCache(specs, self.num_kv_blocks, self.block_size,
                                     self.cache_dtype, self.device)
        self.kv_cache.number_layers(self.model)
        self.decode_kernel: DecodeKernel | None = None
        if self.device.type == "cpu" and not model_config.enforce_eager:
            self.decode_kernel = self._compile_decode_attention(specs)
        self.compiled = False
        if model_config.compile_model and self.compute_threads is not None:
            if self.lora is not None:
                logger.info("LoRA layers are not compiled: the model runs eagerly")
            else:
                self.compiled = self._compile_model(specs, self.compute_threads)

    # -- set-up --------------------------------------------------------------------

    @torch.inference_mode()
    def _profile(self) -> dict[int, KVCacheSpec]:
        """Run a forward without a cache to find the attention layers and, on CUDA, the
        activation memory of a full step."""
        tokens = _PROFILE_TOKENS
        if self.device.type == "cuda":
            tokens = min(self.config.scheduler.max_num_batched_tokens,
                         self.config.model.max_model_len)
            torch.cuda.reset_peak_memory_stats(self.device)
        recorder = ProfileRecorder()
        metadata = PagedAttentionMetadata(
            kv_cache=None, slot_mapping=torch.empty(0, dtype=torch.long), profile=recorder)
        input_ids = torch.zeros(1, tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens, device=self.device)[None]
        self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                   logits_to_keep=1, triollm_metadata=metadata)
        if not recorder.layers:
            raise RuntimeError("the model never called its attention interface")
        return recorder.layers

    @torch.inference_mode()
    def _compile_decode_attention(self, specs: dict[int, KVCacheSpec]) -> DecodeKernel | None:
        """The CPU decode attention: the C kernel (cpu_decode.py) where it builds, else
        ``torch.compile``'d ``paged_decode_attention``, compiled now for every layer's
        shape with a forward of two dummy decodes (block 0's slots get overwritten
        before any request reads them). Either is checked by that forward; a failure
        (no C compiler, say) leaves the gather path."""
        kernel = self.cpu_kernel
        if kernel is not None and self._try_decode_kernel(kernel, specs):
            return kernel
        if self.cache_dtype != torch.float32:
            # checked against torch when it loaded, so this is a bug, not a toolchain
            raise RuntimeError(f"the CPU decode kernel failed its first run; the "
                               f"{self.cache_dtype} cache has no other decode path")
        if self._try_decode_kernel(compiled_paged_decode_attention, specs):
            return compiled_paged_decode_attention
        return None

    def _dummy_sizes(self, specs: dict[int, KVCacheSpec]) -> tuple[int, int]:
        """A batch size and a block-table width for a forward that compiles: torch.compile
        ties sizes that are equal when it compiles ("duck sizing") and compiles again once
        they differ, so neither may equal any of the cache's or the model's dimensions."""
        hf_config = self.config.model.hf_config
        taken = {self.num_kv_blocks, self.block_size, *(
            size for spec in specs.values() for size in (spec.num_kv_heads, spec.head_dim))}
        taken |= {int(getattr(hf_config, name, 0) or 0) for name in (
            "num_attention_heads", "hidden_size", "intermediate_size", "num_hidden_layers")}
        rows, columns = [n for n in (5, 7, 11, 13, 17, 19, 23, 29, 31) if n not in taken][:2]
        return rows, columns

    def _dummy_decodes(self, rows: int, columns: int, kernel: DecodeKernel | None,
                       compiled: bool) -> torch.Tensor:
        """A forward of ``rows`` decodes over tables of ``columns`` copies of block 0,
        whose slots get overwritten before any request reads them."""
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.arange(rows, dtype=torch.long, device=self.device),
            decode_groups=self._decode_groups([[0] * columns] * rows,
                                              list(range(rows, 0, -1))),
            decode_kernel=kernel,
        )
        return self._forward(torch.arange(rows, dtype=torch.long, device=self.device),
                             torch.arange(rows - 1, -1, -1, device=self.device), 1, metadata,
                             compiled)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 keep: int | torch.Tensor, metadata: PagedAttentionMetadata,
                 compiled: bool) -> torch.Tensor:
        """The logits of a ``[T]`` batch's ``keep`` rows; a compiled model takes the
        metadata through ``forward_metadata`` instead of a keyword."""
        if compiled:
            with forward_metadata(metadata):
                return self.model(input_ids=input_ids[None], position_ids=positions[None],
                                  use_cache=False, logits_to_keep=keep).logits[0]
        return self.model(input_ids=input_ids[None], position_ids=positions[None],
                          use_cache=False, logits_to_keep=keep,
                          triollm_metadata=metadata).logits[0]

    def _try_decode_kernel(self, kernel: DecodeKernel, specs: dict[int, KVCacheSpec]) -> bool:
        try:
            self._dummy_decodes(*self._dummy_sizes(specs), kernel, compiled=False)
        except Exception as error:  # compilation needs a working C++ toolchain
            logger.warning("the decode attention %s failed (%s: %s)",
                           getattr(kernel, "__name__", type(kernel).__name__),
                           type(error).__name__, error)
            return False
        return True

    @torch.inference_mode()
    def _compile_model(self, specs: dict[int, KVCacheSpec], threads: ComputeThreads) -> bool:
        """Put the decoder (the model less its head) through ``torch.compile``, dynamic in
        the step's token count, and compile it now for every shape and thread count it
        will meet: one token, several tokens (any number: the attention and the packed
        linears are opaque custom ops), and each count the thread policy may pick, since
        the compiled code is specialised to the thread count. The compiled forward must
        give the eager one's logits; if compiling fails or it does not, the model runs
        eagerly."""
        decoder = self.model.get_decoder()
        counts = threads.ladder()
        rows, columns = self._dummy_sizes(specs)
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 2 * len(counts) + 2)
        started = time.perf_counter()
        try:
            with recording_calls(self.model) as calls:
                expected = self._dummy_decodes(rows, columns, self.decode_kernel,
                                               compiled=False)
            grouped = group_weights_of_shared_inputs(calls)
            decoder.compile(dynamic=True, backend=_inductor_with_shared_input_calls_fused)
            for count in counts:
                torch.set_num_threads(count)
                for batch in (1, rows):
                    got = self._dummy_decodes(batch, columns, self.decode_kernel,
                                              compiled=True)
            tolerance = 1e-3 if self.dtype == torch.float32 else 5e-2
            scale = float(expected.abs().max()) + 1.0
            if not torch.allclose(got.float(), expected.float(), rtol=0.0,
                                  atol=tolerance * scale):
                raise RuntimeError("the compiled forward's logits differ from the eager one's "
                                   f"by {float((got - expected).abs().max()):.3g}")
        except Exception as error:  # a missing or broken C++ toolchain, or a torch bug
            decoder._compiled_call_impl = None
            logger.warning("compiling the model failed (%s: %s); it runs eagerly",
                           type(error).__name__, error)
            return False
        finally:
            torch.set_num_threads(threads.threads)
        threads.keep_to(counts)
        logger.info("compiled the model in %.1f s (thread counts %s; %d groups of linear "
                    "layers on one input)", time.perf_counter() - started, counts, grouped)
        return True

    def _num_blocks(self, specs: dict[int, KVCacheSpec]) -> int:
        cache = self.config.cache
        per_block = PagedKVCache.bytes_per_block(specs, self.block_size, self.cache_dtype)
        if cache.num_gpu_blocks_override is not None:
            blocks = cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(
                self.device)
            budget = total * cache.gpu_memory_utilization - used - peak_extra
            blocks = int(budget // per_block)
        else:
            blocks = int(cache.kv_cache_space_gb * (1 << 30) // per_block)
            # More blocks than every running sequence can fill at full length only cost
            # start-up time and memory on CPU.
            useful = self.config.scheduler.max_num_seqs * -(
                -self.config.model.max_model_len // self.block_size)
            blocks = min(blocks, useful)
        needed = -(-self.config.model.max_model_len // self.block_size)
        if blocks < needed:
            raise ValueError(
                f"max_model_len: the KV cache holds {blocks} blocks of {self.block_size} "
                f"tokens, fewer than one sequence of max_model_len="
                f"{self.config.model.max_model_len} needs ({needed}); lower max_model_len or "
                f"give the cache more memory (kv_cache_space_gb / gpu_memory_utilization / "
                f"num_gpu_blocks_override)")
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", blocks, self.block_size,
                    blocks * per_block / 2**20)
        return blocks

    # -- the step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        started = time.perf_counter()
        for request_id in scheduler_output.finished_request_ids:
            self._requests.pop(request_id, None)
        if scheduler_output.is_empty:
            return RunnerOutput()
        if self.compute_threads is not None:
            self.compute_threads.adjust()
        # Single-token queries first, longest context first, so that decodes of similar
        # length sit next to each other and can share one padded attention call.
        items = sorted(scheduler_output.scheduled,
                       key=lambda item: (item.num_tokens != 1, -item.start_position))
        failed: dict[str, str] = {}
        for item in items:
            if item.request_id not in self._requests:
                try:
                    self._requests[item.request_id] = self._new_state(item)
                except Exception as error:  # this request's own state: it fails alone
                    failed[item.request_id] = f"sampling state: {error!r}"
        if self.lora is not None:
            items = self._begin_lora_step(items, failed)
        elif failed:
            items = [item for item in items if item.request_id not in failed]
        if not items:
            return RunnerOutput(failed=failed)

        metadata, input_ids, positions, keep, keep_owner = self._prepare(items)
        forward_started = time.perf_counter()
        try:
            logits = self._forward(input_ids, positions, keep, metadata, self.compiled)
            if self.sync_forward_time:
                torch.cuda.synchronize(self.device)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        forward_seconds = time.perf_counter() - forward_started
        output = self._sample(items, logits, keep_owner)
        output.failed.update(failed)
        return dataclasses.replace(output, forward_seconds=forward_seconds,
                                   execute_seconds=time.perf_counter() - started)

    def _begin_lora_step(self, items: list[ScheduledRequest], failed: dict[str, str]
                         ) -> list[ScheduledRequest]:
        """Put the step's adapters in their slots; a request whose adapter cannot be
        loaded fails alone (in ``failed``). Returns the items that run."""
        assert self.lora is not None
        while True:
            items = [item for item in items if item.request_id not in failed]
            broken = self.lora.begin_step([item.lora_request for item in items],
                                          [item.num_tokens for item in items])
            if not broken:
                return items
            for item in items:
                if item.lora_request is not None and item.lora_request.lora_int_id in broken:
                    failed[item.request_id] = (f"LoRA adapter {item.lora_request.lora_name!r}: "
                                               f"{broken[item.lora_request.lora_int_id]}")

    # -- LoRA adapters -------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (``ValueError`` naming what does not fit this model);
        False if it was loaded already."""
        return self._lora_manager().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora_manager().loaded_ids()

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with "
                             "enable_lora=True (--enable-lora)")
        return self.lora

    def _new_state(self, item: ScheduledRequest) -> _RequestState:
        generator = None
        if item.sampling.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(item.sampling.seed)
        return _RequestState(item.prompt_token_ids, [], generator)

    def _prepare(
        self, items: list[ScheduledRequest]
    ) -> tuple[PagedAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        keep_owner: list[int] = []  # index into items, for each kept row
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for index, item in enumerate(items):
            start = item.start_position
            count = item.num_tokens
            table = item.block_table
            query_start = len(input_ids)
            input_ids.extend(item.token_ids)
            span = range(start, start + count)
            positions.extend(span)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            if item.wants_prompt_logprobs:
                keep.extend(range(query_start, query_start + count))
                keep_owner.extend([index] * count)
            elif item.sample:
                keep.append(query_start + count - 1)
                keep_owner.append(index)
            context_len = start + count
            if count == 1:
                decode_tables.append(table[: -(-context_len // block_size)])
                decode_lens.append(context_len)
            else:
                used = table[: -(-context_len // block_size)]
                prefills.append(PrefillChunk(
                    query_start, query_start + count, context_len,
                    torch.tensor(used, dtype=torch.long, device=self.device)))

        device = self.device
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            decode_groups=self._decode_groups(decode_tables, decode_lens),
            prefills=prefills,
            decode_kernel=self.decode_kernel,
        )
        return (
            metadata,
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(keep, dtype=torch.long, device=device),
            keep_owner,
        )

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        if isinstance(self.decode_kernel, CpuDecodeKernel):
            # it reads each row's own blocks only: one call for every decode
            padding_keys = 1 << 40
        elif self.decode_kernel is not None:
            padding_keys = _KERNEL_PADDING_KEYS
        else:
            padding_keys = 0
        groups = []
        for start, end in decode_spans([len(t) for t in tables], padding_keys // self.block_size):
            width = len(tables[start])
            padded = [t + [0] * (width - len(t)) for t in tables[start:end]]
            groups.append(DecodeGroup(
                start, end,
                torch.tensor(padded, dtype=torch.long, device=self.device),
                torch.tensor(lens[start:end], dtype=torch.long, device=self.device)))
        return groups

    def _sample(self, items: list[ScheduledRequest], logits: torch.Tensor,
                keep_owner: list[int]) -> RunnerOutput:
        last_row: dict[int, int] = {}
        first_row: dict[int, int] = {}
        for row, owner in enumerate(keep_owner):
            first_row.setdefault(owner, row)
            last_row[owner] = row

        output = RunnerOutput()
        sample_items = [i for i, item in enumerate(items) if item.sample]
        if sample_items:
            rows = [
                SamplingRow(
                    params=items[i].sampling,
                    generator=self._requests[items[i].request_id].generator,
                    prompt_token_ids=items[i].prompt_token_ids,
                    output_token_ids=self._requests[items[i].request_id].output_token_ids,
                )
                for i in sample_items
            ]
            row_index = torch.tensor([last_row[i] for i in sample_items], device=logits.device)
            for i, (token, token_lp) in self._sample_rows(
                    logits[row_index], rows, sample_items, items, output).items():
                request_id = items[i].request_id
                self._requests[request_id].output_token_ids.append(token)
                output.sampled_token_ids[request_id] = token
                if token_lp is not None:
                    output.logprobs[request_id] = token_lp

        for i, item in enumerate(items):
            if item.wants_prompt_logprobs and item.request_id not in output.failed:
                try:
                    output.prompt_logprobs[item.request_id] = self._prompt_logprobs(
                        item, logits[first_row[i]: last_row[i] + 1])
                except Exception as error:
                    output.failed[item.request_id] = f"prompt logprobs: {error!r}"
        return output

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow],
                     sample_items: list[int], items: list[ScheduledRequest],
                     output: RunnerOutput) -> dict[int, tuple[int, TokenLogprobs | None]]:
        """Sample every row at once; if that raises, row by row, so that a row whose
        own parameters or state break sampling fails alone (in ``output.failed``)."""
        try:
            tokens, logprobs = sample(logits, rows, self.generator)
            return dict(zip(sample_items, zip(tokens, logprobs, strict=True), strict=True))
        except Exception:
            logger.warning("batched sampling failed; sampling row by row", exc_info=True)
        sampled = {}
        for row_index, (i, row) in enumerate(zip(sample_items, rows, strict=True)):
            try:
                [token], [token_lp] = sample(logits[row_index:row_index + 1], [row],
                                             self.generator)
            except Exception as error:
                output.failed[items[i].request_id] = f"sampling: {error!r}"
                continue
            sampled[i] = (token, token_lp)
        return sampled

    def _prompt_logprobs(self, item: ScheduledRequest,
                         chunk_logits: torch.Tensor) -> list[TokenLogprobs]:
        prompt = item.prompt_token_ids
        last = min(item.start_position + item.num_tokens, len(prompt) - 1)
        count = last - item.start_position
        logprobs = torch.log_softmax(chunk_logits[:count].float(), dim=-1)
        top_k = item.sampling.prompt_logprobs
        return [
            token_logprobs(logprobs[j], prompt[item.start_position + j + 1], top_k)
            for j in range(count)
        ]

    def shutdown(self) -> None:
        drain_pools()  # no kernel helper reads the weights or the cache once they go
        self._requests.clear()
        del self.kv_cache
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
