"""vLLM's ``/tokenize`` (a prompt, or chat messages through the template) and
``/detokenize``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from triollm.engine.detokenizer import decode_text
from triollm.sampling_params import check_text
from triollm.server.errors import OpenAIError, bad_request
from triollm.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from triollm.server.state import ChatRendering, ServerState, server_state

__all__ = ["router"]

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """The reply is written from the token ids' JSON as the tokenizer made it (in a
    worker process, for a long text): no Python object per token on the event loop."""
    state = server_state(request)
    state.check_model(body.model)
    state.check_fields(body)
    if body.messages is not None:
        rendering = ChatRendering(
            chat_template=body.chat_template, add_generation_prompt=body.generation_prompt,
            continue_final_message=body.continue_final_message,
            # for messages vLLM's default is False (the template writes them)
            add_special_tokens=body.add_special_tokens and "add_special_tokens"
            in body.model_fields_set,
            tools=body.tools, documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs)
        text = await state.render_chat_text(body.messages, rendering)
        special, field = rendering.add_special_tokens, "messages"
    elif body.prompt is not None:
        text, special, field = body.prompt, body.add_special_tokens, "prompt"
    else:
        raise OpenAIError(400, "prompt: give a prompt or messages", param="prompt")
    try:
        check_text(field, text)
    except ValueError as error:
        raise bad_request(error) from error
    count, tokens = await state.offload.encode_json(text, special)
    max_model_len = state.engine.config.model.max_model_len
    return Response(b'{"tokens":%b,"count":%d,"max_model_len":%d}'
                    % (tokens, count, max_model_len), media_type="application/json")


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = server_state(request)
    state.check_model(body.model)
    state.check_fields(body)
    max_model_len = state.engine.config.model.max_model_len
    if len(body.tokens) > max_model_len:
        # decoding holds the GIL, so even in a thread its length must be bounded
        raise OpenAIError(400, f"tokens: at most this model's context, {max_model_len} "
                               f"ids; got {len(body.tokens)}", param="tokens")
    return DetokenizeResponse(prompt=await state.offload.run(_decode, state, body.tokens))


def _decode(state: ServerState, tokens: list[int]) -> str:
    tokenizer = state.engine.tokenizer
    vocab = int(state.engine.config.model.hf_config.vocab_size)
    if any(not 0 <= t < max(vocab, len(tokenizer)) for t in tokens):
        raise OpenAIError(400, "tokens: contains ids outside the vocabulary",
                          param="tokens")
    return decode_text(tokenizer, tokens)
