"""How a caller's prompt and parameters become a request the core can queue.

``RequestIntake.build`` checks both against the engine (its limits, its scheduling
policy, the kind of model it serves), processes the prompt (engine/inputs.py), takes its
own copy of the parameters with the engine's fields filled in, and makes one ``Request``
per sample, each with its detokenizer, under ids the core makes. It raises
``ValueError`` naming the field and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from triollm.config import EngineConfig
from triollm.engine.detokenizer import Tokenizer
from triollm.engine.inputs import PromptType, bad_words_token_ids, process_prompt
from triollm.engine.output_processor import OutputProcessor, ParentRequest
from triollm.engine.request import Request
from triollm.engine.stop_strings import StopStrings
from triollm.lora.request import LoRARequest
from triollm.pooling_params import PoolingParams
from triollm.reasoning.abstract import ReasoningParser
from triollm.sampling_params import RequestOutputKind, SamplingParams
from triollm.structured_output.grammar import CompiledGrammar, StructuredOutputRequest
from triollm.structured_output.reasoning_gate import ReasoningGate

__all__ = ["RequestIntake"]


class RequestIntake:
    """Validates and builds requests for one engine."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None,
                 output_processor: OutputProcessor, clock: Callable[[], float]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.output_processor = output_processor
        self.clock = clock
        self.vocab_size = int(config.model.hf_config.vocab_size)
        self.max_model_len = config.model.max_model_len
        self.max_logprobs = (self.vocab_size if config.model.max_logprobs == -1
                             else min(config.model.max_logprobs, self.vocab_size))

    def build(self, request_id: str, engine_id: Callable[[], str], prompt: PromptType,
              params: SamplingParams | PoolingParams, *, arrival_time: float | None,
              priority: int, is_latency_sensitive: bool, slo: float | None,
              ttft_slo: float | None, lora: tuple[LoRARequest, int] | None,
              trace_headers: Mapping[str, str] | None,
              grammar: CompiledGrammar | None = None,
              reasoning_parser: ReasoningParser | None = None) -> ParentRequest:
        """The request, its samples under ids from ``engine_id()`` (called once per id).
        ``lora`` is the adapter as it was added, with its weights' version; ``grammar``
        the compiled constraint, applied once ``reasoning_parser`` (if any) sees the
        reasoning end."""
        if isinstance(params, PoolingParams):
            self._check_scheduling(priority, slo, ttft_slo)
            return self._pooling(request_id, engine_id, prompt, params, arrival_time,
                                 priority, is_latency_sensitive, trace_headers)
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        pooler = self.config.model.pooler
        if pooler is not None:
            raise ValueError(f"sampling_params: {self.config.model.served_model_name!r} is "
                             f"loaded with runner='pooling' ({pooler.task}); it does not "
                             f"generate text")
        params = params.clone()  # the caller's object is theirs; the engine fills in ours
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}: {value} is more than this engine allows "
                                 f"(max_logprobs={self.max_logprobs})")
        self._check_scheduling(priority, slo, ttft_slo)
        params.check_token_ids(self.vocab_size)
        processed = process_prompt(prompt, self.tokenizer, max_model_len=self.max_model_len,
                                   vocab_size=self.vocab_size,
                                   truncate_to=params.truncate_prompt_tokens)
        arrival = self.clock() if arrival_time is None else arrival_time
        params.all_stop_token_ids = set(params.stop_token_ids or ())
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: this engine has no tokenizer to encode them")
            params.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.output_processor.eos_token_ids
        adapter, lora_version = (None, 0) if lora is None else lora
        structured = None if grammar is None else StructuredOutputRequest(
            grammar, None if reasoning_parser is None
            else ReasoningGate(reasoning_parser, processed.token_ids))
        parent_id = engine_id()
        children = []
        stop = StopStrings(params.stop or ())  # one automaton for every sample
        for index in range(params.n):
            child_params = params if params.n == 1 else params.child(index)
            child_id = parent_id if params.n == 1 else engine_id()
            child = Request(child_id, processed.token_ids, child_params, arrival,
                            priority=priority, index=index,
                            is_latency_sensitive=is_latency_sensitive, slo=slo,
                            ttft_slo=ttft_slo, cache_salt=processed.cache_salt,
                            lora_request=adapter, lora_version=lora_version,
                            structured_output=structured)
            child.detokenizer = self.output_processor.make_detokenizer(
                child_params, processed.token_ids, stop)
            children.append(child)
        return ParentRequest(request_id, parent_id, processed.text, processed.token_ids,
                             params.output_kind, children, trace_headers=trace_headers)

    def _check_scheduling(self, priority: int, slo: float | None,
                          ttft_slo: float | None) -> None:
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError("priority: a non-zero priority needs scheduling_policy='priority'")
        for name, value in (("slo", slo), ("ttft_slo", ttft_slo)):
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}")

    def _pooling(self, request_id: str, engine_id: Callable[[], str], prompt: PromptType,
                 params: PoolingParams, arrival_time: float | None, priority: int,
                 is_latency_sensitive: bool,
                 trace_headers: Mapping[str, str] | None) -> ParentRequest:
        model = self.config.model
        if model.pooler is None:
            raise ValueError(f"pooling_params: {model.served_model_name!r} is loaded with "
                             f"runner='generate'; load it with runner='pooling' to embed, "
                             f"classify or score")
        params = params.resolved(model.pooler, model.served_model_name)
        truncate = params.truncate_prompt_tokens
        processed = process_prompt(
            prompt, self.tokenizer, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, generating=False,
            truncate_to=self.max_model_len if truncate == -1 else truncate)
        params.token_type_ids = processed.token_type_ids
        parent_id = engine_id()
        request = Request(parent_id, processed.token_ids, None,
                          self.clock() if arrival_time is None else arrival_time,
                          pooling_params=params, priority=priority,
                          is_latency_sensitive=is_latency_sensitive)
        return ParentRequest(request_id, parent_id, processed.text, processed.token_ids,
                             RequestOutputKind.FINAL_ONLY, [request], pooling=True,
                             trace_headers=trace_headers)
