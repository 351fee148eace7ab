"""``/v1/models`` and ``/v1/models/{name}``: the served model under each of its names."""

from __future__ import annotations

from fastapi import APIRouter, Request

from triollm.server.protocol import ModelCard, ModelList
from triollm.server.state import ServerState, server_state

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[_card(state, name) for name in state.settings.served_model_names])


@router.get("/v1/models/{model_name:path}", response_model=ModelCard)
async def model(model_name: str, request: Request) -> ModelCard:
    """One served model (``client.models.retrieve``); 404 for any other name."""
    state = server_state(request)
    state.check_model(model_name)
    return _card(state, model_name)


def _card(state: ServerState, name: str) -> ModelCard:
    config = state.engine.config.model
    return ModelCard(id=name, root=config.model, max_model_len=config.max_model_len)
