"""The offline ``LLM`` class: vLLM's batch API over the synchronous engine core."""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from tqdm.auto import tqdm

from triollm.config import DEMO_MODEL_NAME
from triollm.engine.args import EngineArgs
from triollm.engine.assembly import assemble_core, create_model_runner, load_engine_tokenizer
from triollm.engine.inputs import PromptType, TokensPrompt
from triollm.entrypoints.chat_utils import ContentFormat, render_chat
from triollm.entrypoints.score_utils import plan_scoring, score_pairs
from triollm.errors import RequestFailedError
from triollm.lora.request import LoRARequest
from triollm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    EngineOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from triollm.pooling_params import PoolingParams, PoolingTask
from triollm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LLM"]


class LLM:
    """Generate for a batch of prompts, with continuous batching underneath.

    >>> llm = LLM()  # the built-in demo model (random weights: it writes noise)
    >>> outputs = llm.generate(["Hello"], SamplingParams(max_tokens=8), use_tqdm=False)
    >>> len(outputs[0].outputs[0].token_ids) <= 8
    True
    """

    def __init__(self, model: str = DEMO_MODEL_NAME, **engine_args: Any) -> None:
        """Resolve the arguments (vLLM's ``EngineArgs`` names), load the tokenizer and
        the model, and size the KV cache."""
        if engine_args.get("async_scheduling"):
            raise ValueError("async_scheduling: LLM runs each step in the calling thread, "
                             "so none can be scheduled while another computes; use "
                             "AsyncLLMEngine (or triollm serve) for it")
        if engine_args.get("data_parallel_size", 1) != 1:
            raise ValueError("data_parallel_size: LLM runs one engine in the calling "
                             "process; as in vLLM, offline data parallelism is one LLM per "
                             "process, each given its share of the prompts (or serve with "
                             "triollm serve --data-parallel-size N)")
        engine_args.pop("data_parallel_size", None)
        config = EngineArgs(model=model, **{**engine_args, "async_scheduling": False}
                            ).create_engine_config()
        self.tokenizer = load_engine_tokenizer(config)
        parts = assemble_core(config, create_model_runner(config), self.tokenizer)
        self.engine = parts.core
        self._ids = itertools.count()
        #: Each finished request's span goes to ``otlp_traces_endpoint``, from a thread
        #: that lives as long as this object (flushed when it is collected, or at exit).
        self._tracer = parts.tracer
        if self._tracer is not None:
            weakref.finalize(self, self._tracer.shutdown)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters a prompt gets when none are given: vLLM's defaults
        with the model's generation_config.json (or ``override_generation_config``) on
        top, as the server applies them to fields a request leaves out."""
        return SamplingParams(**self.engine.config.model.generation_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in input order. ``priority`` (one
        per prompt, lower first) needs ``scheduling_policy="priority"``.
        ``lora_request`` (one for all prompts, or one per prompt, None for the base
        model) needs ``enable_lora=True``; prompts for different adapters and for the
        base model run in the same steps."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params() for _ in prompt_list]
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params: got {len(params_list)} for "
                                 f"{len(prompt_list)} prompts")
        final = [SamplingParams(**{**params._as_kwargs(),
                                   "output_kind": RequestOutputKind.FINAL_ONLY})
                 for params in params_list]
        outputs = self._run(prompt_list, final, _priorities(priority, len(prompt_list)),
                            use_tqdm, _adapters(lora_request, len(prompt_list)))
        return [output for output in outputs if isinstance(output, RequestOutput)]

    # -- pooling models (runner="pooling") ---------------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        pooling_task: PoolingTask | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """One ``PoolingRequestOutput`` per prompt, in input order: ``outputs.data`` is
        a 1-D float32 tensor (an embedding or label scores). Needs a pooling model."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"pooling_params: got {len(params_list)} for "
                                 f"{len(prompt_list)} prompts")
        overrides: dict[str, Any] = {}
        if pooling_task is not None:
            overrides["task"] = pooling_task
        if truncate_prompt_tokens is not None:
            overrides["truncate_prompt_tokens"] = truncate_prompt_tokens
        if overrides:
            params_list = [dataclasses.replace(p, **overrides) for p in params_list]
        outputs = self._run(prompt_list, params_list,
                            _priorities(priority, len(prompt_list)), use_tqdm)
        return [output for output in outputs if isinstance(output, PoolingRequestOutput)]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``, a list of floats), with an
        embedding model."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed",
                              truncate_prompt_tokens=truncate_prompt_tokens,
                              priority=priority)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Label probabilities per prompt (``outputs.probs``), with a sequence
        classifier."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="classify",
                              priority=priority)
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """The relevance of each pair: ``data_1`` (one text, or one per item of
        ``data_2``) against ``data_2``. A cross-encoder reads each pair as one prompt;
        an embedding model gives the cosine similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        pooler = self.engine.config.model.pooler
        if pooler is None:
            raise ValueError("score: this model is loaded with runner='generate'; scoring "
                             "needs an embedding model or a cross-encoder")
        plan = plan_scoring(pooler, cast(Any, self.tokenizer), pairs,
                            max_length=self.engine.config.model.max_model_len,
                            truncate_prompt_tokens=truncate_prompt_tokens)
        # a cross-encoder's pairs were truncated as they were tokenized
        outputs = self.encode(plan.prompts, pooling_params, use_tqdm, pooling_task=plan.task,
                              truncate_prompt_tokens=None if plan.pair_indices is None
                              else truncate_prompt_tokens)
        if plan.pair_indices is None:
            return [ScoringRequestOutput.from_base(output) for output in outputs]
        scores = plan.scores([output.outputs.data for output in outputs])
        return [ScoringRequestOutput(
            request_id=f"score-{index}", outputs=ScoringOutput(score),
            prompt_token_ids=outputs[a].prompt_token_ids + outputs[b].prompt_token_ids)
            for index, (score, (a, b)) in enumerate(zip(scores, plan.pair_indices,
                                                        strict=True))]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (between ``generate`` calls no request holds
        blocks, so it always can; returns whether it did)."""
        return self.engine.reset_prefix_cache()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_content_format: ContentFormat = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the chat template (vLLM's
        arguments: content given as a string or as OpenAI's text parts,
        ``continue_final_message`` to continue the last assistant message, extra
        template variables in ``chat_template_kwargs``)."""
        conversations: list[list[dict[str, Any]]]
        if messages and isinstance(messages[0], list):
            conversations = cast(list[list[dict[str, Any]]], messages)
        else:
            conversations = [cast(list[dict[str, Any]], messages)]
        prompts: list[PromptType] = [TokensPrompt(prompt_token_ids=render_chat(
            self.tokenizer, list(conversation), chat_template=chat_template,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, tools=tools,
            documents=documents, chat_template_kwargs=chat_template_kwargs,
            content_format=chat_template_content_format))
            for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _trace_finished(self) -> None:
        """Queue the spans of the requests finished since the last call (with tracing)."""
        if self._tracer is not None:
            self._tracer.record(self.engine.take_stats())

    def _run(self, prompts: list[PromptType],
             params_list: Sequence[SamplingParams | PoolingParams],
             priorities: list[int], use_tqdm: bool,
             adapters: list[LoRARequest | None] | None = None) -> list[EngineOutput]:
        engine = self.engine
        ids = [f"{next(self._ids)}" for _ in prompts]
        adapters = adapters or [None] * len(prompts)
        for adapter in adapters:
            if adapter is not None and not engine.has_lora(adapter):
                engine.add_lora(adapter)
        added: list[str] = []
        try:
            for request_id, prompt, params, priority, adapter in zip(
                    ids, prompts, params_list, priorities, adapters, strict=True):
                engine.add_request(request_id, prompt, params, priority=priority,
                                   lora_request=adapter)
                added.append(request_id)
        except BaseException:
            engine.abort_requests(added)
            raise
        results: dict[str, EngineOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        started = time.perf_counter()
        generated = 0
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                self._trace_finished()
                for failure in engine.take_failures():
                    raise RequestFailedError(f"request {failure.request_id!r} failed: "
                                             f"{failure.error}")
                for output in outputs:
                    if output.finished:
                        results[output.request_id] = output
                        generated += (sum(len(c.token_ids) for c in output.outputs)
                                      if isinstance(output, RequestOutput)
                                      else len(output.prompt_token_ids))
                        bar.update(1)
                        elapsed = time.perf_counter() - started
                        bar.set_postfix_str(f"{generated / elapsed:.1f} toks/s")
        except BaseException:
            engine.abort_requests(ids)
            raise
        finally:
            self._trace_finished()  # the aborted ones too
            bar.close()
        return [results[request_id] for request_id in ids]


def _adapters(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
              count: int) -> list[LoRARequest | None] | None:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    adapters = list(lora_request)
    if len(adapters) != count:
        raise ValueError(f"lora_request: got {len(adapters)} for {count} prompts")
    return adapters


def _priorities(priority: Sequence[int] | None, count: int) -> list[int]:
    priorities = [0] * count if priority is None else list(priority)
    if len(priorities) != count:
        raise ValueError(f"priority: got {len(priorities)} for {count} prompts")
    return priorities


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]  # one prompt given as token ids
    # Each item is validated as a prompt when it is added to the engine.
    return cast(list[PromptType], items)
