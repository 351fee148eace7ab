"""Speculative decoding under structured outputs, on both grammar backends and both
methods: drafts are cut at the first token the grammar forbids (prompt lookup proposes
prompt tokens the grammar forbids; a draft model proposes under the grammar's masks),
each verified position samples under the mask, so the outputs are those of the
engine without speculation, token for token, and follow the grammar."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from test_speculative_draft import noisy_copy
from test_speculative_models import ENGINE
from triollm import LLM, SamplingParams
from triollm.structured_output import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 8}
PATTERNS = [r"(ab ){1,8}", r"[ab ]{1,40}"]


@pytest.fixture(scope="module")
def noisy_llama(tmp_path_factory: pytest.TempPathFactory, llama_path: Path) -> Path:
    return noisy_copy(llama_path, tmp_path_factory.mktemp("noisy") / "llama", 0.005)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_constrained_outputs_match_without_speculation(
        backend: str, llama_path: Path, noisy_llama: Path, tokenizer: Any) -> None:
    prompts = [{"prompt_token_ids": tokenizer("ab ab ab ab ab ab ab ab")["input_ids"]},
               {"prompt_token_ids": [20, 21, 22, 23] * 6}]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=(
        StructuredOutputsParams(regex=pattern))) for pattern in PATTERNS]
    config = {"structured_outputs_config": {"backend": backend}, **ENGINE}
    plain = LLM(str(llama_path), **config).generate(prompts * 2, params * 2)
    expected = [list(o.outputs[0].token_ids) for o in plain]
    for output, pattern in zip(plain, PATTERNS * 2, strict=True):
        assert re.fullmatch(pattern, output.outputs[0].text)
    draft = {"method": "draft_model", "model": str(noisy_llama), "num_speculative_tokens": 3,
             "disable_by_batch_size": 8}
    for spec in (NGRAM, draft):
        llm = LLM(str(llama_path), speculative_config=spec, **config)
        outputs = llm.generate(prompts * 2, params * 2)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected, spec["method"]
        stats = llm.engine.statistics().spec_decoding
        assert stats is not None and stats.num_accepted_tokens > 0, spec["method"]
