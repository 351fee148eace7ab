"""The one start-up line an operator reads: ``engine ready:`` with the settings in
effect, for generation and pooling runners alike, and the load's own timed lines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from triollm import LLM


def _ready_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.getMessage().startswith("engine ready:")]


def test_a_generation_engine_logs_one_summary_of_its_settings(
        llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="triollm"):
        LLM(str(llama_path), dtype="float32", max_model_len=96, max_num_seqs=5,
            num_gpu_blocks_override=40, cpu_threads=1)
    (line,) = _ready_lines(caplog)
    for setting in ("dtype float32", "KV cache float32", "40 blocks of 16 tokens",
                    "max_model_len 96", "max_num_seqs 5", "1 thread",
                    "optimization level 0 (eager", "decode attention:", "packed"):
        assert setting in line, (setting, line)


def test_a_pooling_engine_logs_one_summary_of_its_settings(
        pooling_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="triollm"):
        LLM(str(pooling_models["bert"]), dtype="float32", max_num_seqs=7,
            max_num_batched_tokens=512, cpu_threads=1)
    (line,) = _ready_lines(caplog)
    for setting in ("pooling (embed)", "dtype float32", "no KV cache", "max_num_seqs 7",
                    "max_num_batched_tokens 512", "1 thread", "prompt attention:"):
        assert setting in line, (setting, line)
