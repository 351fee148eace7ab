from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A C kernel this CPU supports that fails to build, warns, or disagrees with torch when
# it loads is an error in the tests, not a warning and a slower path (model/cpu/build.py).
os.environ.setdefault("TRIOLLM_STRICT_KERNELS", "1")
logging.getLogger("transformers").setLevel(logging.ERROR)

settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session", autouse=True)
def eager_models_by_default() -> Any:
    """Engines the tests build run their models eagerly unless a test asks for
    ``optimization_level``: compiling each tiny model would take most of the suite's time.
    The compiled forward has its own tests (test_compiled_model.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("triollm.engine.args.DEFAULT_OPTIMIZATION_LEVEL", 0)
        yield


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from triollm.testing import train_test_tokenizer

    return train_test_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> dict[str, Path]:
    """One saved random-weight model per supported family, built once per session."""
    from transformers.utils import logging as hf_logging

    from triollm.testing import TINY_FAMILIES, build_tiny_model

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: build_tiny_model(family, root / family, tokenizer)
            for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def llama_path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def llama_llm(llama_path: Path) -> Any:
    """The tiny Llama in float32 behind one offline ``LLM``, shared by the tests that
    need nothing else of it (between ``generate`` calls it holds no request)."""
    from triollm import LLM

    return LLM(str(llama_path), dtype="float32", max_model_len=256,
               num_gpu_blocks_override=256)


@pytest.fixture(scope="session")
def pooling_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random-weight pooling models: sentence-transformers folders and classifiers."""
    from transformers.utils import logging as hf_logging

    from triollm.testing import build_cross_encoder, build_embedding_model

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("pooling-models")
    return {
        "bert": build_embedding_model("bert", root / "bert", dense_features=48),
        "xlmr": build_embedding_model("xlm-roberta", root / "xlmr"),
        "qwen2": build_embedding_model("qwen2", root / "qwen2"),
        "qwen3": build_embedding_model("qwen3", root / "qwen3", seed=7),
        "gemma2": build_embedding_model("gemma2", root / "gemma2", seed=3),
        "matryoshka": build_embedding_model("bert", root / "matryoshka", seed=3,
                                            is_matryoshka=True),
        "cross": build_cross_encoder(root / "cross"),
        "labels": build_cross_encoder(root / "labels", num_labels=3, seed=5),
    }


POISON = 77
POISON_MODELING = f'''
import time

from transformers import LlamaForCausalLM


class PoisonLlamaForCausalLM(LlamaForCausalLM):
    """Raises when the poison token reaches the model. Each step also takes at least
    10 ms, so streams are still running when a test sends the poison."""

    def forward(self, input_ids=None, **kwargs):
        if input_ids is not None and bool((input_ids == {POISON}).any()):
            raise RuntimeError("poison token reached the model")
        time.sleep(0.01)
        return super().forward(input_ids=input_ids, **kwargs)
'''


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any,
                tiny_models: dict[str, Path]) -> dict[str, Path]:
    """Adapters of different ranks, scalings and target modules for the tiny Llama, and
    one for GPT-2, whose attention is one fused Conv1D (c_attn)."""
    from triollm.testing import build_lora_adapter

    root = tmp_path_factory.mktemp("lora")
    llama = tiny_models["llama"]
    return {
        "llama": llama,
        "qv8": build_lora_adapter(llama, root / "qv8", rank=8, alpha=16,
                                  target_modules=("q_proj", "v_proj"), seed=1),
        "all4": build_lora_adapter(llama, root / "all4", rank=4, alpha=8,
                                   target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"),
                                   seed=2, use_rslora=True),
        "mlp16": build_lora_adapter(llama, root / "mlp16", rank=16, alpha=8,
                                    target_modules=("gate_proj", "up_proj", "down_proj", "o_proj"),
                                    seed=3, rank_pattern={"down_proj": 2},
                                    alpha_pattern={"o_proj": 32}),
        "kv2": build_lora_adapter(llama, root / "kv2", rank=2, alpha=4,
                                  target_modules=("k_proj", "v_proj"), seed=4),
        "rank32": build_lora_adapter(llama, root / "rank32", rank=32, seed=5),
        "dora": build_lora_adapter(llama, root / "dora", rank=4, seed=6, use_dora=True),
        "gpt2": tiny_models["gpt2"],
        "gpt2_attn": build_lora_adapter(tiny_models["gpt2"], root / "gpt2_attn", rank=8,
                                        target_modules=("c_attn", "c_fc"), seed=7,
                                        fan_in_fan_out=True),
    }


@pytest.fixture(scope="session")
def poison_model(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A tiny Llama loaded with trust_remote_code whose forward raises on ``POISON``."""
    from triollm.testing import build_tiny_model

    path = build_tiny_model("llama", tmp_path_factory.mktemp("poison") / "model", tokenizer)
    (path / "modeling_poison.py").write_text(POISON_MODELING)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_poison.PoisonLlamaForCausalLM"}
    config["architectures"] = ["PoisonLlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session", params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on trio and on asyncio."""
    return str(request.param)
