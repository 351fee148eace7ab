"""Engines that load their models at the same time in one process (two model threads):
transformers' loading swaps process-wide state while it runs, so triollm's loader lets
one load through at a time, and a tied LM head loaded afterwards is still tied."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from triollm.model import loader


def _load(path: Path) -> torch.nn.Module:
    config = loader.load_hf_config(str(path))
    return loader.load_model(str(path), config, attn_implementation="sdpa",
                             dtype=torch.float32, device=torch.device("cpu"))


def test_loads_that_overlap_in_threads_leave_later_loads_whole(
        tiny_models: dict[str, Path]) -> None:
    failures: list[BaseException] = []

    def load_twice() -> None:
        try:
            for _ in range(2):
                _load(tiny_models["llama"])
        except BaseException as failure:
            failures.append(failure)

    threads = [threading.Thread(target=load_twice) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []
    tied = _load(tiny_models["gpt2"])
    head = tied.get_output_embeddings().weight
    assert head is tied.get_input_embeddings().weight
    assert head.device.type == "cpu"
