"""``distributed_executor_backend="ray"``: rank 1 as a Ray actor on a local Ray instance
(one per module: two CPUs, no dashboard) decodes greedily as one rank does; without
Ray the flag says how to get it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from triollm import LLM, EngineArgs, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
PROMPTS = ["hello world", "the quick brown fox jumps over"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_a_ray_actor_rank_decodes_greedily_as_one_rank_does(
        local_ray: Any, llama_path: Path, llama_llm: Any) -> None:
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in llama_llm.generate(PROMPTS, GREEDY,
                                                                   use_tqdm=False)]
        assert got == want
    finally:
        llm.engine.runner.shutdown()
    table = local_ray.util.placement_group_table()
    assert table and all(group["state"] == "REMOVED" for group in table.values())


def test_without_ray_the_flag_says_how_to_get_it(llama_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "ray" else real(name, *args))
    with pytest.raises(ValueError, match=r"pip install 'triollm\[ray\]'"):
        EngineArgs(model=str(llama_path), tensor_parallel_size=2,
                   distributed_executor_backend="ray").create_engine_config()
