"""LoRA adapters through the server: ``--lora-modules``, ``model: "<adapter>"`` on the
routes through the official openai client (greedy tokens equal transformers + PEFT
running each adapter alone, adapters and the base in flight together), ``/v1/models``,
and the runtime load/unload routes behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers import peft_greedy
from server_helpers import ThreadedServer, server_in_thread, server_process
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.server.routes.lora import LoRAModulePath

MODEL = "tiny-llama"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(lora_models: dict[str, Path]) -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(model=str(lora_models["llama"]), dtype="float32", max_model_len=256,
                           num_gpu_blocks_override=256, enable_lora=True, max_loras=2,
                           max_lora_rank=16)
    engine = AsyncLLMEngine.from_engine_args(args)
    previous = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        with server_in_thread(engine, served_model_names=(MODEL,), lora_modules=(
                LoRAModulePath("qv8", str(lora_models["qv8"])),
                LoRAModulePath("all4", str(lora_models["all4"]), base_model_name=MODEL),
        )) as running:
            yield running
    finally:
        if previous is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = previous
    assert not running.errors, running.errors


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def completion_tokens(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert reply.model == model
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return [int(token.removeprefix("token_id:")) for token in logprobs.tokens]


def test_models_lists_the_adapters_with_the_base_as_parent(
        client: openai.OpenAI, lora_models: dict[str, Path]) -> None:
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {MODEL, "qv8", "all4"}
    for name in ("qv8", "all4"):
        card: Any = cards[name]
        assert card.parent == MODEL and card.root == str(lora_models[name])
    assert client.models.retrieve("qv8").id == "qv8"


def test_adapters_and_the_base_in_flight_together_match_peft(
        client: openai.OpenAI, lora_models: dict[str, Path], tokenizer: Any) -> None:
    prompts = [tokenizer(text).input_ids for text in ("Hello there, how", "Once upon a time")]
    plan = [(model, prompt) for prompt in prompts for model in ("qv8", "all4", MODEL)] * 2
    with ThreadPoolExecutor(len(plan)) as pool:
        got = list(pool.map(lambda job: completion_tokens(client, *job), plan))
    for (model, prompt), tokens in zip(plan, got, strict=True):
        adapter = None if model == MODEL else lora_models[model]
        assert tokens == peft_greedy(lora_models["llama"], adapter, [prompt], MAX_TOKENS)[0]


def test_chat_and_streaming_take_the_adapter_name(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Say something"}]
    reply = client.chat.completions.create(model="all4", messages=messages, max_tokens=6,
                                           temperature=0)
    assert reply.model == "all4"
    chunks = list(client.chat.completions.create(model="all4", messages=messages,
                                                 max_tokens=6, temperature=0, stream=True))
    assert {chunk.model for chunk in chunks} == {"all4"}
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.chat.completions.create(model="nope", messages=messages, max_tokens=2)


def test_adapters_load_and_unload_at_run_time(
        server: ThreadedServer, client: openai.OpenAI, lora_models: dict[str, Path],
        tokenizer: Any, tmp_path: Path) -> None:
    def post(route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)

    loaded = post("load_lora_adapter", {"lora_name": "kv2", "lora_path": str(lora_models["kv2"])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'kv2' added successfully."
    assert "kv2" in {card.id for card in client.models.list().data}
    prompt = tokenizer("The quick brown fox").input_ids
    assert completion_tokens(client, "kv2", prompt) == peft_greedy(
        lora_models["llama"], lora_models["kv2"], [prompt], MAX_TOKENS)[0]

    again = post("load_lora_adapter", {"lora_name": "kv2", "lora_path": str(lora_models["kv2"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # in place, from another adapter's folder: the name now serves those weights
    swapped = post("load_lora_adapter", {"lora_name": "kv2", "load_inplace": True,
                                         "lora_path": str(lora_models["mlp16"])})
    assert swapped.status_code == 200, swapped.text
    assert completion_tokens(client, "kv2", prompt) == peft_greedy(
        lora_models["llama"], lora_models["mlp16"], [prompt], MAX_TOKENS)[0]

    unloaded = post("unload_lora_adapter", {"lora_name": "kv2"})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    assert "kv2" not in {card.id for card in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        completion_tokens(client, "kv2", prompt)
    gone = post("unload_lora_adapter", {"lora_name": "kv2"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"

    refusals = [
        ({"lora_name": "big", "lora_path": str(lora_models["rank32"])}, 400,
         "above max_lora_rank=16"),
        ({"lora_name": "gpt", "lora_path": str(lora_models["gpt2_attn"])}, 400,
         "is not an adaptable layer of this model"),
        ({"lora_name": "none", "lora_path": str(tmp_path / "missing")}, 404, "no LoRA adapter"),
        ({"lora_name": MODEL, "lora_path": str(lora_models["qv8"])}, 400,
         "conflicts with a served base model"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": "/a", "surprise": 1}, 400, "surprise"),
    ]
    for body, status, message in refusals:
        answer = post("load_lora_adapter", body)
        assert answer.status_code == status, (body, answer.text)
        assert message in answer.json()["error"]["message"], answer.text
    assert {card.id for card in client.models.list().data} == {MODEL, "qv8", "all4"}
    # the server still serves its adapters
    assert completion_tokens(client, "qv8", prompt) == peft_greedy(
        lora_models["llama"], lora_models["qv8"], [prompt], MAX_TOKENS)[0]


def test_triollm_serve_with_lora_modules(lora_models: dict[str, Path], tokenizer: Any) -> None:
    """The command line: --enable-lora --lora-modules in both spellings; without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING the runtime routes do not exist."""
    os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    with server_process(
            str(lora_models["llama"]), "--dtype", "float32", "--max-model-len", "128",
            "--num-gpu-blocks-override", "64", "--enable-lora", "--max-lora-rank", "8",
            "--lora-modules", f"qv8={lora_models['qv8']}",
            f'{{"name": "kv2", "path": "{lora_models["kv2"]}"}}') as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert {card.id for card in client.models.list().data} == {
            str(lora_models["llama"]), "qv8", "kv2"}
        prompt = tokenizer("Once upon a time").input_ids
        for name in ("qv8", "kv2"):
            assert completion_tokens(client, name, prompt) == peft_greedy(
                lora_models["llama"], lora_models[name], [prompt], MAX_TOKENS)[0]
        answer = httpx.post(url + "/v1/load_lora_adapter", timeout=30,
                            json={"lora_name": "a", "lora_path": str(lora_models["all4"])})
        assert answer.status_code == 404


def test_a_bad_lora_module_stops_the_start_up_naming_it(lora_models: dict[str, Path]) -> None:
    with pytest.raises(RuntimeError, match=r"rank 32 .* above max_lora_rank=16"), \
            server_process(str(lora_models["llama"]), "--dtype", "float32",
                           "--max-model-len", "128", "--num-gpu-blocks-override", "64",
                           "--enable-lora", "--lora-modules",
                           f"big={lora_models['rank32']}"):
        pass
