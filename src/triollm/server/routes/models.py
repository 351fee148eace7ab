"""``/v1/models`` and ``/v1/models/{name}``: the served model under each of its names,
and each LoRA adapter with the base model as its ``parent``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from triollm.server.protocol import ModelCard, ModelList
from triollm.server.state import ServerState, server_state

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[_card(state, name) for name in (
        *state.settings.served_model_names, *state.loras)])


@router.get("/v1/models/{model_name:path}", response_model=ModelCard)
async def model(model_name: str, request: Request) -> ModelCard:
    """One served model (``client.models.retrieve``); 404 for any other name."""
    state = server_state(request)
    state.check_model(model_name)
    return _card(state, model_name)


def _card(state: ServerState, name: str) -> ModelCard:
    config = state.engine.config.model
    lora = state.loras.get(name)
    if lora is not None:  # as vLLM: the adapter's path as root, its base as parent
        return ModelCard(id=name, root=lora.lora_path, max_model_len=config.max_model_len,
                         parent=lora.base_model_name or state.settings.served_model_names[0])
    return ModelCard(id=name, root=config.model, max_model_len=config.max_model_len)
