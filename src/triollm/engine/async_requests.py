"""Requests through the async engine: ``generate`` and ``encode`` add one to the core
and stream its outputs from its ``RequestChannel`` (engine/channel.py); leaving a stream
early, or ``abort``, aborts it at once.

``AsyncEngineRequests`` is a base of ``AsyncLLMEngine`` (engine/async_engine.py), whose
step loop fills the channels.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Iterable, Mapping
from contextlib import aclosing

import anyio

from triollm.engine.async_api import AsyncEngineAPI
from triollm.engine.channel import RequestChannel
from triollm.engine.inputs import PromptType
from triollm.errors import EngineClosedError
from triollm.log_text import MAX_LOGGED_PARAMS_CHARS, clipped
from triollm.lora.request import LoRARequest
from triollm.outputs import EngineOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from triollm.pooling_params import PoolingParams
from triollm.sampling_params import SamplingParams
from triollm.structured_output.grammar import CompiledGrammar

__all__ = ["AsyncEngineRequests"]

logger = logging.getLogger(__name__)

#: Threads that compile constraints at once: a flood of distinct schemas waits for them
#: rather than taking the default pool's 40 threads (and every core) from the rest.
COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))


def _shown_prompt(prompt: PromptType, max_log_len: int | None) -> object:
    """A prompt as request logs show it: its text and token ids cut to ``max_log_len``."""
    if max_log_len is None:
        return prompt
    if isinstance(prompt, str | list):
        return prompt[:max_log_len]
    if isinstance(prompt, Mapping):
        return {key: value[:max_log_len] if key in ("prompt", "prompt_token_ids")
                and isinstance(value, str | list) else value
                for key, value in prompt.items()}
    return prompt


class AsyncEngineRequests(AsyncEngineAPI):
    """Adding, streaming and aborting requests."""

    log_requests: bool
    max_log_len: int | None
    _warned_tracing: bool
    #: The compile threads' limiter, made on first use (inside the event loop).
    _compile_threads: anyio.CapacityLimiter | None
    #: Set when a request arrives; the idle step loop waits on it.
    _work_available: anyio.Event | None

    def _wake(self) -> None:
        if self._work_available is not None:
            self._work_available.set()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        is_latency_sensitive: bool = False,
        slo: float | None = None,
        ttft_slo: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request.

        The stream ends after the output with ``finished=True``. Leaving the loop early
        (break, cancellation) aborts the request; close the generator promptly with
        ``contextlib.aclosing`` when breaking out. Raises ``ValueError`` for bad input,
        ``EngineDeadError`` if the engine died and ``EngineClosedError`` if it shut down.
        ``priority`` (lower first) needs ``scheduling_policy="priority"``.
        ``is_latency_sensitive``, ``slo`` (target seconds per output token) and
        ``ttft_slo`` (target seconds to the first token) mark a request for SLO-aware
        co-serving under ``scheduling_policy="slo"``; whether it met them is in the final
        output's ``metrics.slo_attained``. ``sampling_params=None`` takes
        ``get_default_sampling_params()``. ``lora_request`` runs the request through a
        LoRA adapter (``enable_lora``), loaded on first use.
        """
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        trace_headers = self._trace_headers(trace_headers)
        if lora_request is not None:
            await self._ensure_lora(lora_request)
        grammar = await self._compile_grammar(sampling_params, request_id)
        channel = self._add_request(prompt, sampling_params, request_id, priority,
                                    is_latency_sensitive, slo, ttft_slo, lora_request,
                                    trace_headers, grammar)
        async with aclosing(self._stream(channel)) as stream:
            async for output in stream:
                assert isinstance(output, RequestOutput)
                yield output

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        *,
        is_latency_sensitive: bool = False,
    ) -> AsyncGenerator[PoolingRequestOutput[PoolingOutput], None]:
        """Pool one prompt with a pooling model (``runner="pooling"``): yields one
        finished ``PoolingRequestOutput`` whose ``outputs.data`` is a 1-D float32
        tensor (an embedding, or a classifier's label scores). Leaving early aborts the
        request; an aborted request's stream ends without an output. Raises
        ``ValueError`` for bad input or a generation model (and for a ``lora_request``:
        LoRA adapters are served over generation models)."""
        trace_headers = self._trace_headers(trace_headers)
        channel = self._add_request(prompt, pooling_params or PoolingParams(), request_id,
                                    priority, is_latency_sensitive, lora_request=lora_request,
                                    trace_headers=trace_headers)
        async with aclosing(self._stream(channel)) as stream:
            async for output in stream:
                assert isinstance(output, PoolingRequestOutput)
                yield output

    def _trace_headers(self, trace_headers: Mapping[str, str] | None
                       ) -> Mapping[str, str] | None:
        """The headers to parent the request's span with; None without tracing."""
        if trace_headers is None:
            return None
        if not isinstance(trace_headers, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in trace_headers.items()):
            raise ValueError("trace_headers: must be a mapping of header names to strings")
        if self.config.observability.otlp_traces_endpoint is None:
            if trace_headers and not self._warned_tracing:
                # as vLLM when no OTLP endpoint is set: said once, the request goes on
                self._warned_tracing = True
                logger.warning("Received a request with trace context but tracing is "
                               "disabled (start the engine with otlp_traces_endpoint, "
                               "--otlp-traces-endpoint, to export spans)")
            return None
        return {name.lower(): value for name, value in trace_headers.items()}

    def _stream(self, channel: RequestChannel) -> AsyncGenerator[EngineOutput, None]:
        """The outputs of one request; closing it before the end aborts the request
        (callers close it at once with ``aclosing``)."""
        return channel.outputs(lambda: self._abort_now(channel))

    async def _compile_grammar(self, params: SamplingParams, request_id: str
                               ) -> CompiledGrammar | None:
        """A request's constraint compiled in a worker thread, off the event loop (a
        large schema takes a while); ``ValueError`` naming the field if it is invalid."""
        core = self._core
        if (core is None or not isinstance(params, SamplingParams)
                or params.structured_outputs is None):
            return None
        if self._compile_threads is None:
            self._compile_threads = anyio.CapacityLimiter(COMPILE_THREADS)
        return await anyio.to_thread.run_sync(core.compile_structured_outputs, params,
                                              request_id, limiter=self._compile_threads)

    def _add_request(self, prompt: PromptType, params: SamplingParams | PoolingParams,
                     request_id: str,
                     priority: int, is_latency_sensitive: bool = False,
                     slo: float | None = None,
                     ttft_slo: float | None = None,
                     lora_request: LoRARequest | None = None,
                     trace_headers: Mapping[str, str] | None = None,
                     grammar: CompiledGrammar | None = None) -> RequestChannel:
        self._raise_if_dead()
        core = self._core
        if not self._running or core is None:
            raise EngineClosedError("the engine is not running: use `async with engine` or "
                                    "`await task_group.start(engine.run)`")
        if request_id in self._channels:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        engine_id = core.add_request(request_id, prompt, params, priority=priority,
                                     is_latency_sensitive=is_latency_sensitive, slo=slo,
                                     ttft_slo=ttft_slo, lora_request=lora_request,
                                     trace_headers=trace_headers, grammar=grammar)
        channel = self._channels.open(request_id, params.output_kind, engine_id)
        if self.log_requests:
            self._log_request(request_id, prompt, params)
        self._wake()
        return channel

    def _log_request(self, request_id: str, prompt: PromptType,
                     params: SamplingParams | PoolingParams) -> None:
        logger.info("Received request %s: prompt: %r, params: %s.", clipped(request_id),
                    _shown_prompt(prompt, self.max_log_len),
                    clipped(params, MAX_LOGGED_PARAMS_CHARS))

    def _abort_now(self, channel: RequestChannel) -> None:
        """Abort the request behind ``channel`` (by its engine id: a request that reuses
        the caller's id since is not touched) and end its stream."""
        core = self._core
        outputs: list[EngineOutput] = []
        if core is not None:
            outputs.extend(core.abort_engine_requests([channel.engine_id]))
        self._channels.close(channel, outputs)
        if outputs:
            self._record_stats()
            if self.log_requests:
                logger.info("Aborted request %s.", clipped(channel.request_id))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several: each stream ends with a final output whose
        finish_reason is ``"abort"``. Finished or unknown ids are ignored."""
        self._raise_if_dead()
        for one_id in [request_id] if isinstance(request_id, str) else request_id:
            channel = self._channels.get(one_id)
            if channel is not None:
                self._abort_now(channel)
        await anyio.lowlevel.checkpoint()
