"""``GET /v1/models``: the served model and its LoRA adapters."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["ModelCard", "ModelList"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "triollm"
    root: str | None = None
    #: For a LoRA adapter: the base model it runs over.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
