"""Tensor parallelism (model/parallel/): a model sharded over two ranks, the second in a
child process, gives the same greedy tokens as one rank in float32; the arguments it
cannot honour are refused by name."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from triollm import LLM, EngineArgs, SamplingParams
from triollm.testing import tiny_config

PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "hello world again"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def tokens(llm: Any, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                use_tqdm=False)]


def no_rank_processes() -> bool:
    import psutil

    return not any("rank_worker" in " ".join(child.cmdline())
                   for child in psutil.Process().children(recursive=True))


class ThreadExecutor:
    """Rank 1 in a thread of this process: the same rank code as the ``mp`` executor's
    child, without starting an interpreter (the families' shards, cheaply)."""

    def __init__(self, config: Any, cpus: Any) -> None:
        self.config = config
        self.messages: queue.Queue[bytes] = queue.Queue()
        self.thread: threading.Thread | None = None

    def start(self) -> Any:
        from triollm.model.parallel.group import connect_store, join_group
        from triollm.model.parallel.rank_worker import RankJob, RankWorker

        store = connect_store("127.0.0.1", 0, 2, driver=True)
        job = RankJob(self.config, 1, "127.0.0.1", store.port)

        def serve() -> None:
            worker = RankWorker(job)
            while message := self.messages.get():
                worker.run_step(message)
            worker.shutdown()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        return join_group(0, 2, store, 5.0, self.config.model.device)

    def send(self, message: bytes) -> None:
        self.messages.put(message)

    def check(self) -> None:
        pass

    def shutdown(self) -> None:
        self.messages.put(b"")
        if self.thread is not None:
            self.thread.join(10)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_each_family_decodes_greedily_on_two_ranks_as_on_one(
        tiny_models: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("triollm.model.parallel.runner._executor", ThreadExecutor)
    path = str(tiny_models[family])
    one = tokens(LLM(path, dtype="float32", max_model_len=256), PROMPTS)
    two_ranks = LLM(path, dtype="float32", max_model_len=256, tensor_parallel_size=2)
    assert tokens(two_ranks, PROMPTS) == one


@pytest.fixture(scope="module")
def small_cache_llm(llama_path: Path) -> Iterator[Any]:
    """Two ranks with a cache of 12 blocks of 16 tokens and 32-token steps: long prompts
    are chunked, shared prefixes cached, and four requests preempt each other. Its rank
    process ends with the runner's shutdown."""
    llm = LLM(str(llama_path), dtype="float32", max_model_len=128, tensor_parallel_size=2,
              num_gpu_blocks_override=12, max_num_batched_tokens=32)
    yield llm
    llm.engine.runner.shutdown()
    assert no_rank_processes()


def test_a_rank_process_decodes_greedily_as_one_rank_does(small_cache_llm: Any,
                                                          llama_llm: Any) -> None:
    assert not no_rank_processes()
    assert tokens(small_cache_llm, PROMPTS) == tokens(llama_llm, PROMPTS)


def test_chunked_prefill_prefix_caching_and_preemption_keep_the_tokens(
        small_cache_llm: Any, llama_llm: Any) -> None:
    prefix = " ".join(["shared prefix words"] * 6)
    prompts = [prefix + " one", prefix + " two", prefix + " three", "short"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = tokens(llama_llm, prompts, params)
    assert tokens(small_cache_llm, prompts, params) == want
    stats = small_cache_llm.engine.scheduler.statistics()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tensor_parallel_size": 3}, "3 does not divide the model's num_attention_heads"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "needs mp or ray"),
    ({"tensor_parallel_size": 2, "enable_lora": True}, "LoRA adapters"),
    ({"tensor_parallel_size": 2, "runner": "pooling"}, "pooling models run on one rank"),
    ({"distributed_executor_backend": "threads"}, "distributed_executor_backend"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"distributed_timeout_seconds": 0}, "distributed_timeout_seconds"),
])
def test_what_cannot_be_sharded_is_refused_by_name(llama_path: Path, overrides: dict[str, Any],
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(llama_path), **overrides).create_engine_config()


def test_a_family_without_a_plan_is_refused_by_name(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="'opt' family has no tensor-parallel plan"):
        EngineArgs(model=str(tiny_models["opt"]),
                   tensor_parallel_size=2).create_engine_config()


def test_the_executor_defaults_to_mp_for_several_ranks(llama_path: Path) -> None:
    config = EngineArgs(model=str(llama_path), tensor_parallel_size=2).create_engine_config()
    assert config.parallel.distributed_executor_backend == "mp"
    assert config.parallel.world_size == 2
    assert not config.model.compile_model
    one = EngineArgs(model=str(llama_path)).create_engine_config()
    assert one.parallel.distributed_executor_backend == "uni"


def test_a_vocabulary_that_does_not_split_evenly_is_padded(
        tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr("triollm.model.parallel.runner._executor", ThreadExecutor)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", len(tokenizer) + 1))
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.15)
    path = str(tmp_path / "odd")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    want = tokens(LLM(path, dtype="float32", max_model_len=128), PROMPTS[:2])
    two_ranks = LLM(path, dtype="float32", max_model_len=128, tensor_parallel_size=2)
    assert tokens(two_ranks, PROMPTS[:2]) == want


def test_each_rank_takes_its_core_list_and_a_wrong_count_is_refused(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from triollm.model.parallel.runner import rank_placement

    core = min(os.sched_getaffinity(0))
    config = EngineArgs(model=str(llama_path), tensor_parallel_size=2).create_engine_config()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{core}|{core}")
    placed, cpus = rank_placement(config)
    assert cpus == [(core,), (core,)] and placed.model.cpu_threads == 1
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{core}|{core}|{core}")
    with pytest.raises(ValueError, match="3 core lists for tensor_parallel_size=2"):
        rank_placement(config)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    placed, cpus = rank_placement(config)
    assert cpus == [None, None]
    assert placed.model.cpu_threads == max(1, len(os.sched_getaffinity(0)) // 2)




def test_each_ranks_tied_int4_head_ranks_the_rows_that_want_only_the_argmax(
        tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's message tells rank 1 which rows want only the argmax: its slice of the
    head ranks them as the driver's does."""
    import torch
    from transformers import AutoModelForCausalLM

    from test_rescored_head import ranked_calls

    monkeypatch.setattr("triollm.model.parallel.runner._executor", ThreadExecutor)
    config = tiny_config("llama", 4096, hidden_size=128, head_dim=32,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.15)
    path = str(tmp_path / "tied")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 128, "quantization": "int4",
                            "tensor_parallel_size": 2}
    greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    two_ranks = LLM(path, **args)
    calls = ranked_calls(monkeypatch)
    tokens(two_ranks, PROMPTS, greedy)
    assert len(set(calls)) == 2, "the driver's and rank 1's heads should both rank"
