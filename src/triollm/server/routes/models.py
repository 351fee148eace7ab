"""``/v1/models``: the served model under each of its names."""

from __future__ import annotations

from fastapi import APIRouter, Request

from triollm.server.protocol import ModelCard, ModelList
from triollm.server.state import server_state

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    state = server_state(request)
    model = state.engine.config.model
    return ModelList(data=[ModelCard(id=name, root=model.model,
                                     max_model_len=model.max_model_len)
                           for name in state.settings.served_model_names])
