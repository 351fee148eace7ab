"""Engine outputs as OpenAI fields: usage, completion and chat logprobs, vLLM's
``prompt_logprobs``. Pure functions of the outputs; no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from triollm.engine.detokenizer import Tokenizer, decode_text
from triollm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from triollm.server.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokenLogprob,
    TopLogprob,
    UsageInfo,
)
from triollm.server.protocol import (
    PromptLogprobs as PromptLogprobsField,
)
from triollm.server.request import ReplyOptions

__all__ = ["chat_logprobs", "completion_logprobs", "json_logprob", "prompt_logprobs",
           "token_text", "usage", "usage_info", "usage_options"]


def usage(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage_info(prompt, completion)


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def usage_options(body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage)``: as in vLLM, per-chunk usage
    (``continuous_usage_stats``) counts only together with ``include_usage``."""
    options = body.stream_options
    include = bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


def json_logprob(logprob: float) -> float:
    """JSON has no -inf: an impossible token is reported as -9999.0."""
    return max(logprob, -9999.0)


def token_text(token_id: int, logprob: Logprob | None, as_token_ids: bool,
               tokenizer: Tokenizer | None = None) -> str:
    """A logprob entry's token: ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)
    or its text."""
    if as_token_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode_text(tokenizer, [token_id]) if tokenizer is not None else ""


def completion_logprobs(completion: CompletionOutput, start_offset: int,
                        prompt: tuple[list[int], PromptLogprobs] | None = None,
                        tokenizer: Tokenizer | None = None, as_token_ids: bool = False
                        ) -> CompletionLogprobs:
    """The completions API's logprobs: the echoed prompt's positions (``prompt``: its
    token ids and logprobs) first, then the completion's, with text offsets from
    ``start_offset``; tokens as ``token_id:N`` with ``as_token_ids``."""
    result = CompletionLogprobs()
    offset = start_offset
    pairs: list[tuple[int, dict[int, Logprob] | None]] = []
    if prompt is not None:
        pairs.extend(zip(*prompt, strict=True))
    pairs.extend(zip(completion.token_ids, completion.logprobs or [], strict=False))
    for token_id, position in pairs:
        chosen = position.get(token_id) if position else None
        text = token_text(token_id, chosen, as_token_ids, tokenizer)
        result.tokens.append(text)
        result.token_logprobs.append(json_logprob(chosen.logprob) if chosen else None)
        result.top_logprobs.append(
            {token_text(top_id, lp, as_token_ids): json_logprob(lp.logprob)
             for top_id, lp in position.items()} if position else None)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def prompt_logprobs(reply: ReplyOptions, output: RequestOutput
                    ) -> PromptLogprobsField | None:
    """vLLM's ``prompt_logprobs`` field, when the request asked for it."""
    if not reply.prompt_logprobs:
        return None
    return [None if position is None else {
        token: PromptTokenLogprob(logprob=json_logprob(lp.logprob), rank=lp.rank,
                                  decoded_token=lp.decoded_token)
        for token, lp in position.items()} for position in output.prompt_logprobs or []]


def chat_logprobs(completion: CompletionOutput, top: int, as_token_ids: bool = False
                  ) -> ChatLogprobs:
    """The chat API's logprobs, with ``top`` alternatives per token; tokens as
    ``token_id:N`` with ``as_token_ids``."""
    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or [],
                                  strict=False):
        chosen = position.get(token_id)
        if chosen is None:
            continue
        text = token_text(token_id, chosen, as_token_ids)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top]
        alternatives = []
        for top_id, lp in ranked:
            top_text = token_text(top_id, lp, as_token_ids)
            alternatives.append(TopLogprob(token=top_text, logprob=json_logprob(lp.logprob),
                                           bytes=list(top_text.encode())))
        content.append(ChatTokenLogprob(
            token=text, logprob=json_logprob(chosen.logprob), bytes=list(text.encode()),
            top_logprobs=alternatives))
    return ChatLogprobs(content=content)
