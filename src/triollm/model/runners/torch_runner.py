"""The torch model runner: one forward per engine step over a flattened batch.

It owns the transformers model, the paged KV cache and the per-request sampling state
(seeded generators, token history for penalties, a constrained sample's grammar
matcher). Its set-up (setup.py: CPU preparation, profiling, KV sizing; compile.py: the
decode attention and the compiled model) runs in the constructor; a step computes the
constrained samples' allowed tokens in a helper thread while it prepares the flattened
batch (batch.py) and runs the forward, then samples, and computes prompt
log-probabilities where asked.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from triollm.config import EngineConfig
from triollm.model.attention.kernel import DecodeKernel
from triollm.model.attention.kv_storage import cache_storage_dtype
from triollm.model.attention.metadata import KVCacheSpec, PagedKVCache
from triollm.model.attention.paged import ATTENTION_NAME
from triollm.model.cpu.decode import load_kernel
from triollm.model.cpu.helpers import drain_pools
from triollm.model.cpu.threads import ComputeThreads
from triollm.model.draft_verify import verify_drafts
from triollm.model.loader import load_model
from triollm.model.lora.manager import LoRAManager
from triollm.model.parallel.plan import shard_model
from triollm.model.runners.background_compile import BackgroundCompile, background_build
from triollm.model.runners.batch import DecodeAttention, prepare_batch, run_forward
from triollm.model.runners.compile import (
    SCRATCH_BLOCKS,
    DummyDecodes,
    choose_decode_attention,
    compile_model,
    plan_compile,
)
from triollm.model.runners.compile_cache import use_private_compile_cache
from triollm.model.runners.draft_model import DraftModel, Proposal
from triollm.model.runners.setup import num_kv_blocks, prepare_for_cpu, profile_kv_specs
from triollm.model.runners.summary import attention_name, compile_mode, log_summary
from triollm.model.sampler import SamplingRow, sample, token_logprobs
from triollm.step import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from triollm.structured_output.bitmask import GrammarMask
from triollm.structured_output.matchers import MaskFiller, PendingMask, SampleGrammar

if TYPE_CHECKING:
    from collections.abc import Callable

    from triollm.lora.request import LoRARequest
    from triollm.model.parallel.group import RankGroup

__all__ = ["TorchModelRunner"]

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    #: Structured outputs: the sample's matcher (None: unconstrained).
    grammar: SampleGrammar | None = None
    #: A draft model's proposal for the request's next step.
    proposal: Proposal | None = None


class TorchModelRunner:
    """Runs a transformers causal LM with triollm's paged attention."""

    def __init__(self, config: EngineConfig, parallel: RankGroup | None = None) -> None:
        """Load and set up the model; with ``parallel``, as that tensor-parallel rank's
        shard (model/parallel/): every rank runs this set-up in step."""
        self._started = time.perf_counter()
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
        # so the cache is fp32 too. --kv-cache-dtype fp8* stores it in 8 bits whatever
        # reads it (model/attention/kv_storage.py).
        on_cpu = self.device.type == "cpu"
        cpu_kernel = load_kernel() if on_cpu and not model_config.enforce_eager else None
        self.cache_dtype = cache_storage_dtype(config.cache.cache_dtype) or (
            torch.float32 if on_cpu and cpu_kernel is None else self.dtype)
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
            quantization=(model_config.quantization.method
                          if model_config.quantization is not None else None),
        )
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        spec = config.speculative
        self.draft = (DraftModel(config, self.vocab_size)
                      if spec is not None and spec.model is not None else None)
        sharded = shard_model(self.model, parallel) if parallel is not None else None
        self.compute_threads: ComputeThreads | None = (
            prepare_for_cpu(self.model, model_config.cpu_threads,
                            model_config.quantization) if on_cpu else None)
        if sharded is not None:
            sharded.install(self.model)
        self.lora = (LoRAManager(self.model, config.lora, self.device)
                     if config.lora is not None else None)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(model_config.seed)
        self._requests: dict[str, _RequestState] = {}
        self.mask_filler = MaskFiller(self.vocab_size, self.device)
        #: Called with a step's requests just before its forward (the tensor-parallel
        #: driver sends them to the other ranks).
        self.on_batch: Callable[[list[ScheduledRequest]], None] | None = None

        def profile() -> dict[int, KVCacheSpec]:
            return profile_kv_specs(self.model, config)

        sizing = time.perf_counter()
        logger.debug("sizing the KV cache...")
        # the profile forward also shows which layers read the same input (LoRA groups)
        specs = self.lora.calibrate(profile) if self.lora is not None else profile()
        # A draft model's cache has the same blocks: each costs both models' bytes.
        self.num_kv_blocks = num_kv_blocks(
            config, specs | (self.draft.specs if self.draft is not None else {}),
            self.cache_dtype)
        if parallel is not None:  # each rank sized its own slice: the smallest holds
            self.num_kv_blocks = parallel.agree_min(self.num_kv_blocks)
        self.kv_cache = PagedKVCache(specs, self.num_kv_blocks, self.block_size,
                                     self.cache_dtype, self.device)
        self.kv_cache.number_layers(self.model)
        logger.info("sized and allocated the KV cache in %.1f s",
                    time.perf_counter() - sizing)
        self.decode_attention = DecodeAttention()
        #: Whether steps run the compiled forward (with ``compile_in_background``, from
        #: the first step after the compile thread has built and checked it).
        self.compiled = False
        self._background: BackgroundCompile | None = None
        self._compile_counts: list[int] = []
        if on_cpu and not model_config.enforce_eager:
            use_private_compile_cache()
            dummy = DummyDecodes(self.model, self.kv_cache, config, specs)
            choosing = time.perf_counter()
            self.decode_attention = choose_decode_attention(dummy, cpu_kernel,
                                                            self.cache_dtype)
            logger.info("decode attention: %s (checked in %.1f s)",
                        attention_name(self.decode_attention),
                        time.perf_counter() - choosing)
            if model_config.compile_model and self.compute_threads is not None:
                if self.lora is not None:
                    logger.info("LoRA layers are not compiled: the model runs eagerly")
                elif model_config.compile_in_background:
                    self._background = self._compile_in_background(specs)
                else:
                    self.compiled = compile_model(dummy, self.decode_attention,
                                                  self.compute_threads, self.dtype)
        if self.draft is not None:
            self.draft.allocate(self.num_kv_blocks, self.cache_dtype, self.decode_attention)
        log_summary(config, self.model, self.kv_cache, self.compute_threads,
                    self.decode_attention,
                    compile_mode(config, self.compiled, self._background is not None))

    def _compile_in_background(self, specs: dict[int, KVCacheSpec]
                               ) -> BackgroundCompile | None:
        """Start the compile thread (background_compile.py) over a scratch cache of its
        own; None (the model stays eager) where planning the compile fails."""
        assert self.compute_threads is not None
        scratch = PagedKVCache(specs, SCRATCH_BLOCKS, self.block_size, self.cache_dtype,
                               self.device)
        dummy = DummyDecodes(self.model, scratch, self.config, specs)
        try:
            plan = plan_compile(dummy, self.decode_attention, self.compute_threads.ladder())
        except Exception as error:
            logger.warning("compiling the model failed (%s: %s); it runs eagerly",
                           type(error).__name__, error)
            return None
        self._compile_counts = plan.counts
        return BackgroundCompile(background_build(dummy, self.decode_attention, plan,
                                                  self.config, self.cache_dtype))

    def switch_when_compiled(self) -> None:
        """At a step boundary, in the model thread: take the compiled forward once the
        compile thread has built and checked it (or forget the thread if it failed).
        ``execute_model`` calls it first; the engine calls it while idle, so that an
        idle server switches too."""
        background = self._background
        if background is None or not background.done:
            return
        self._background = None
        background.close()
        if background.compiled and self.compute_threads is not None:
            self.compute_threads.keep_to(self._compile_counts)
            self.compiled = True
            logger.info("compiled forward in use after %.1f s",
                        time.perf_counter() - self._started)

    def wait_for_compile(self, timeout: float | None = None) -> bool:
        """Block (any thread) until no compile thread is building the compiled forward,
        at most ``timeout`` seconds; returns whether none is."""
        background = self._background
        return background is None or background.wait(timeout)

    @property
    def compiling(self) -> bool:
        """Whether a compile thread is still building the compiled forward (once it has
        built it, the next step switches to it)."""
        return self._background is not None and not self._background.done

    @property
    def switch_pending(self) -> bool:
        """Whether a background compile has not been switched to or forgotten yet
        (``switch_when_compiled``)."""
        return self._background is not None

    @property
    def decode_kernel(self) -> DecodeKernel | None:
        """The CPU decode attention's kernel; None: gather the blocks, then SDPA."""
        return self.decode_attention.kernel

    # -- the step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        started = time.perf_counter()
        for request_id in scheduler_output.finished_request_ids:
            self._requests.pop(request_id, None)
        if self.draft is not None:
            self.draft.drop(scheduler_output)
        if self._background is not None:
            self.switch_when_compiled()
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

        masks = self.mask_filler.start([
            (row, grammar) for row, item in enumerate(i for i in items if i.sample)
            if (grammar := self._requests[item.request_id].grammar) is not None])
        if self.on_batch is not None:
            self.on_batch(items)
        batch = prepare_batch(items, self.kv_cache, self.decode_attention, self.device)
        forward_started = time.perf_counter()
        try:
            logits = run_forward(self.model, batch.input_ids, batch.positions, batch.keep,
                                 batch.metadata, self.compiled, batch.argmax_rows)
            if self.sync_forward_time:
                torch.cuda.synchronize(self.device)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        forward_seconds = time.perf_counter() - forward_started
        output = self._sample(items, logits, batch.keep_owner, masks)
        if self.draft is not None:
            for request_id, proposal in self.draft.propose_after(
                    items, output, self._sampling_row,
                    lambda request_id: self._requests[request_id].grammar).items():
                self._requests[request_id].proposal = proposal
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
        grammar = (None if item.structured_output is None
                   else SampleGrammar(item.structured_output))
        if self.draft is not None:
            self.draft.start(item.request_id, item.start_position)
        return _RequestState(item.prompt_token_ids, [], generator, grammar)

    def _sample(self, items: list[ScheduledRequest], logits: torch.Tensor,
                keep_owner: list[int], masks: PendingMask) -> RunnerOutput:
        last_row: dict[int, int] = {}
        first_row: dict[int, int] = {}
        for row, owner in enumerate(keep_owner):
            first_row.setdefault(owner, row)
            last_row[owner] = row

        output = RunnerOutput()
        sample_items = [i for i, item in enumerate(items) if item.sample]
        if sample_items:
            rows = [self._sampling_row(items[i]) for i in sample_items]
            # A request with drafts samples after its first position here, then the
            # drafts are verified (model/draft_verify.py).
            row_index = torch.tensor([first_row[i] if items[i].num_draft_tokens else last_row[i]
                                      for i in sample_items], device=logits.device)
            grammar_mask = masks.wait()
            for row, mask_error in masks.errors.items():
                output.failed[items[sample_items[row]].request_id] = mask_error
            for i, (token, token_lp) in self._sample_rows(
                    logits[row_index], rows, sample_items, items, output,
                    grammar_mask).items():
                request_id = items[i].request_id
                if request_id in output.failed:
                    continue
                state = self._requests[request_id]
                state.output_token_ids.append(token)
                if state.grammar is not None:
                    rejected = state.grammar.accept(state.output_token_ids)
                    if rejected is not None:
                        output.failed[request_id] = rejected
                        continue
                output.sampled_token_ids[request_id] = token
                if token_lp is not None:
                    output.logprobs[request_id] = token_lp
                if items[i].num_draft_tokens:
                    proposal, state.proposal = state.proposal, None
                    drafts = items[i].token_ids[-items[i].num_draft_tokens:]
                    verify_drafts(items[i], logits[first_row[i]:last_row[i] + 1],
                                  rows[sample_items.index(i)],
                                  proposal.probs if proposal is not None
                                  and proposal.token_ids[:len(drafts)] == drafts else None,
                                  output, self.generator, state.grammar)

        for i, item in enumerate(items):
            if item.wants_prompt_logprobs and item.request_id not in output.failed:
                try:
                    output.prompt_logprobs[item.request_id] = self._prompt_logprobs(
                        item, logits[first_row[i]: last_row[i] + 1])
                except Exception as error:
                    output.failed[item.request_id] = f"prompt logprobs: {error!r}"
        return output

    def _sampling_row(self, item: ScheduledRequest) -> SamplingRow:
        state = self._requests[item.request_id]
        return SamplingRow(params=item.sampling, generator=state.generator,
                           prompt_token_ids=item.prompt_token_ids,
                           output_token_ids=state.output_token_ids)

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow],
                     sample_items: list[int], items: list[ScheduledRequest],
                     output: RunnerOutput, grammar_mask: GrammarMask | None
                     ) -> dict[int, tuple[int, TokenLogprobs | None]]:
        """Sample every row at once; if that raises, row by row, so that a row whose
        own parameters or state break sampling fails alone (in ``output.failed``)."""
        try:
            tokens, logprobs = sample(logits, rows, self.generator, grammar_mask)
            return dict(zip(sample_items, zip(tokens, logprobs, strict=True), strict=True))
        except Exception:
            logger.warning("batched sampling failed; sampling row by row", exc_info=True)
        sampled = {}
        for row_index, (i, row) in enumerate(zip(sample_items, rows, strict=True)):
            try:
                [token], [token_lp] = sample(
                    logits[row_index:row_index + 1], [row], self.generator,
                    None if grammar_mask is None else grammar_mask.select(row_index))
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
        if self._background is not None:
            self._background.close()
            self._background = None
        drain_pools()  # no kernel helper reads the weights or the cache once they go
        self.mask_filler.shutdown()
        self._requests.clear()
        if self.draft is not None:
            self.draft.shutdown()
        del self.kv_cache
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
