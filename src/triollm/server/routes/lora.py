"""LoRA adapters as served models: ``--lora-modules`` at start-up and vLLM's runtime
routes, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, which exist only
when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true (as in vLLM: anyone who can reach
the server can then make it read a directory).

An adapter is loaded (and checked against the model) before its name is served, so a
bad one is a 400 (404 when nothing is at its path) and never a failed request later.
Each load takes a new engine id, so an adapter loaded again from another path never
reuses the prefix-cache blocks of the one before.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from triollm.errors import LoRAAdapterNotFoundError
from triollm.log_text import clipped
from triollm.lora.request import LoRARequest
from triollm.server.errors import OpenAIError
from triollm.server.state import ServerState, server_state

__all__ = ["LoRAModulePath", "load_adapter", "parse_lora_module", "router",
           "runtime_updates_allowed"]

logger = logging.getLogger(__name__)

router = APIRouter()

RUNTIME_UPDATES_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_VARIABLE, "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"lora_modules: {text!r} is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"lora_modules: {text!r} must be a JSON object")
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"lora_modules: unknown keys {sorted(unknown)} in {text!r}")
        name, path = value.get("name"), value.get("path")
        base = value.get("base_model_name")
        if not (isinstance(name, str) and name and isinstance(path, str) and path
                and (base is None or isinstance(base, str))):
            raise ValueError(f"lora_modules: {text!r} needs a string 'name' and 'path'")
        return LoRAModulePath(name, path, base)
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"lora_modules: expected name=path or a JSON object, got {text!r}")
    return LoRAModulePath(name, path)


async def load_adapter(state: ServerState, name: str, path: str, *,
                       load_inplace: bool = False, base_model_name: str | None = None) -> None:
    """Load an adapter into the engine and serve it as model ``name``. Raises
    ``OpenAIError``: 400 for a bad adapter or name, 404 when nothing is at ``path``."""
    if name in state.settings.served_model_names:
        raise OpenAIError(400, f"The lora adapter '{name}' conflicts with a served base "
                               f"model.", param="lora_name")
    if name in state.loras and not load_inplace:
        raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded. If you "
                               f"want to load the adapter in place, set 'load_inplace' to "
                               f"True.", param="lora_name")
    previous = state.loras.get(name)
    same_place = previous is not None and previous.lora_path == path
    lora_id = previous.lora_int_id if same_place and previous else next(state.lora_ids)
    base = base_model_name if base_model_name in state.settings.served_model_names else None
    request = LoRARequest(name, lora_id, path, base_model_name=base,
                          load_inplace=same_place)
    try:
        await state.engine.add_lora(request)
    except LoRAAdapterNotFoundError as error:
        raise OpenAIError(404, f"Loading lora {name} failed: {error}", type="NotFoundError",
                          param="lora_path") from error
    except ValueError as error:
        raise OpenAIError(400, f"Loading lora {name} failed: {error}",
                          param="lora_path") from error
    if previous is not None and not same_place:
        await state.engine.remove_lora(previous.lora_int_id)
    state.loras[name] = request
    logger.info("Loaded LoRA adapter: name '%s', path '%s'", clipped(name), clipped(path))


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
    if not body.lora_name or not body.lora_path:
        raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    await load_adapter(server_state(request), body.lora_name, body.lora_path,
                       load_inplace=body.load_inplace)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
    state = server_state(request)
    lora = state.loras.get(body.lora_name)
    if lora is None:
        raise OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                          type="NotFoundError", param="lora_name")
    if body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id:
        raise OpenAIError(400, f"lora_int_id: the lora adapter '{body.lora_name}' has id "
                               f"{lora.lora_int_id}, not {body.lora_int_id}.",
                          param="lora_int_id")
    del state.loras[body.lora_name]
    await state.engine.remove_lora(lora.lora_int_id)
    logger.info("Removed LoRA adapter: name '%s'", clipped(body.lora_name))
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
