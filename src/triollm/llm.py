"""The offline ``LLM`` class: vLLM's batch API over the synchronous engine core."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from tqdm.auto import tqdm

from triollm.config import DEMO_MODEL_NAME
from triollm.engine.args import EngineArgs
from triollm.engine.chat import ContentFormat, render_chat
from triollm.engine.core import EngineCore
from triollm.engine.inputs import PromptType, TokensPrompt
from triollm.errors import RequestFailedError
from triollm.outputs import RequestOutput
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
        from triollm.model.loader import load_tokenizer
        from triollm.model.torch_runner import TorchModelRunner

        config = EngineArgs(model=model, **engine_args).create_engine_config()
        self.tokenizer = load_tokenizer(config.model.tokenizer,
                                        trust_remote_code=config.model.trust_remote_code,
                                        revision=config.model.tokenizer_revision,
                                        download_dir=config.model.download_dir)
        self.engine = EngineCore(config, TorchModelRunner(config), self.tokenizer)
        self._ids = itertools.count()

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
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in input order. ``priority`` (one
        per prompt, lower first) needs ``scheduling_policy="priority"``."""
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
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, priorities, use_tqdm)

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
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams],
             priorities: list[int], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, params, priority in zip(ids, prompts, params_list,
                                                            priorities, strict=True):
                final_params = SamplingParams(**{**params._as_kwargs(),
                                                 "output_kind": RequestOutputKind.FINAL_ONLY})
                engine.add_request(request_id, prompt, final_params, priority=priority)
                added.append(request_id)
        except BaseException:
            engine.abort_requests(added)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        started = time.perf_counter()
        generated = 0
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                for failure in engine.take_failures():
                    raise RequestFailedError(f"request {failure.request_id!r} failed: "
                                             f"{failure.error}")
                for output in outputs:
                    if output.finished:
                        results[output.request_id] = output
                        generated += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - started
                        bar.set_postfix_str(f"output {generated / elapsed:.1f} toks/s")
        except BaseException:
            engine.abort_requests(ids)
            raise
        finally:
            bar.close()
        return [results[request_id] for request_id in ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]  # one prompt given as token ids
    # Each item is validated as a prompt when it is added to the engine.
    return cast(list[PromptType], items)
