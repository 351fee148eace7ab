"""The compiled decoder saved under triollm's cache root (runners/precompiled.py): a
second process with the same model loads it instead of tracing it and gives the same
greedy tokens; an artifact that is corrupt, or that others could have written, is
refused and compiled again; a cache directory others may write is not used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triollm.model.cpu.build import trusted_cache_dir
from triollm.model.runners import precompiled

_ENGINE = """
import json, sys
from triollm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, num_gpu_blocks_override=256,
          optimization_level=2, cpu_threads=1)
decoder = llm.engine.runner.model.get_decoder()._compiled_call_impl
outputs = llm.generate(["The capital of France is", "1, 2, 3,"],
                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print(json.dumps({"compiled": llm.engine.runner.compiled,
                  "loaded": decoder.loaded, "traced": decoder.compiled,
                  "tokens": [o.outputs[0].token_ids for o in outputs]}))
"""


def _engine_in_a_new_process(model: Path, cache: Path) -> tuple[dict[str, object], str]:
    """What a fresh process's compiled engine on ``model`` did, with ``cache`` as
    triollm's cache root (and the test session's torch caches, so that inductor's
    graphs are warm), and its stderr."""
    env = {**os.environ, "TRIOLLM_CACHE": str(cache),
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")
           or str(trusted_cache_dir("torch"))}
    done = subprocess.run([sys.executable, "-c", _ENGINE, str(model)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_restart_loads_the_compiled_model(llama_path: Path, tmp_path: Path) -> None:
    first, _ = _engine_in_a_new_process(llama_path, tmp_path)
    assert first["compiled"] and first["loaded"] == 0 and first["traced"] == 2
    artifacts = sorted((tmp_path / precompiled.CACHE_NAME).glob("*/*.bin"))
    assert len(artifacts) == 2  # one token and several, at one thread
    assert all(os.stat(path).st_mode & 0o077 == 0 for path in artifacts)

    second, _ = _engine_in_a_new_process(llama_path, tmp_path)
    assert second["compiled"] and second["loaded"] == 2 and second["traced"] == 0
    assert second["tokens"] == first["tokens"]


def test_a_corrupt_artifact_or_one_others_may_write_is_refused_and_discarded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    os.chmod(tmp_path, 0o700)
    decoder = precompiled.PrecompiledDecoder(torch.nn.Linear(4, 4), tmp_path,
                                             backend=lambda *args: None)
    corrupt, writable = (decoder._path((1, one)) for one in (True, False))
    assert corrupt is not None and writable is not None
    for path in (corrupt, writable):
        path.write_bytes(b'{"modules": {}}\nnot a compiled function')
        os.chmod(path, 0o600)
    os.chmod(writable, 0o660)
    assert decoder._load((1, True)) is None and decoder._load((1, False)) is None
    assert "could not be loaded" in caplog.text and "not safe to load" in caplog.text
    assert not corrupt.exists()  # discarded, to be compiled and saved anew
    assert decoder.loaded == 0


def test_a_cache_directory_others_may_write_is_not_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    (shared / precompiled.CACHE_NAME).mkdir(parents=True)
    os.chmod(shared / precompiled.CACHE_NAME, 0o777)
    monkeypatch.setenv("TRIOLLM_CACHE", str(shared))
    monkeypatch.delenv("TRIOLLM_STRICT_KERNELS", raising=False)
    directory = precompiled.cache_directory("key")
    assert directory is not None and shared not in directory.parents
    assert "not safe" in caplog.text


def test_the_key_changes_with_what_changes_the_compiled_code() -> None:
    model = torch.nn.Linear(4, 4)
    key = precompiled.artifact_key(model, torch.float32, "kernel")
    assert key == precompiled.artifact_key(model, torch.float32, "kernel")
    assert key != precompiled.artifact_key(model, torch.bfloat16, "kernel")
    assert key != precompiled.artifact_key(model, torch.float32, "another kernel")
