"""`triollm serve` and `triollm generate` report what fails in a second (an address it
cannot listen on, a model that is not there) in one line with exit status 2, before
torch or the model loads; a client that connects while the model loads is refused."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from triollm import AsyncEngineArgs, AsyncLLMEngine, EngineArgs
from triollm.model.source import model_source_problem
from triollm.server.listen import ListenError, bind_listening_sockets, listen_error


def run_triollm(*args: str, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> tuple[int, list[str], set[str]]:
    """``python -X importtime -m triollm ARGS``: its exit status, the lines it wrote to
    stderr, and every module it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "triollm", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, **(env or {})})
    lines = done.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines
                if line.startswith("import time:")}
    return done.returncode, [line for line in lines if not line.startswith("import time:")], \
        imported


@pytest.fixture
def port_in_use() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_port_in_use_stops_serve_in_one_line_before_torch_loads(port_in_use: int) -> None:
    status, errors, imported = run_triollm("serve", "--host", "127.0.0.1", "--port",
                                           str(port_in_use))
    assert status == 2
    assert errors == [f"triollm serve: error: cannot listen on 127.0.0.1:{port_in_use}: "
                      f"address already in use"]
    assert "torch" not in imported and "transformers" not in imported


@pytest.mark.parametrize("command", [["serve", "./no-such-model"],
                                     ["generate", "--model", "./no-such-model", "Hi"]])
def test_a_missing_local_model_path_is_one_line_and_exit_2(tmp_path: Path,
                                                           command: list[str]) -> None:
    status, errors, imported = run_triollm(*command, cwd=tmp_path)
    assert status == 2
    assert errors == [f"triollm {command[0]}: error: model path ./no-such-model does not "
                      f"exist"]
    assert "torch" not in imported


def test_a_hub_id_offline_and_not_cached_is_one_line_and_exit_2(tmp_path: Path) -> None:
    status, errors, imported = run_triollm(
        "serve", "org/no-such-model",
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert status == 2
    assert errors == ["triollm serve: error: model org/no-such-model is not a local "
                      "directory, and not in the Hugging Face cache while HF_HUB_OFFLINE "
                      "is set (nothing is downloaded)"]
    assert "torch" not in imported


def test_a_missing_tokenizer_path_is_named(tmp_path: Path) -> None:
    status, errors, _ = run_triollm("serve", "--tokenizer", "./no-tokenizer", cwd=tmp_path)
    assert (status, errors) == (2, ["triollm serve: error: tokenizer path ./no-tokenizer "
                                    "does not exist"])


def test_engine_args_name_the_model_that_is_not_there(tmp_path: Path) -> None:
    from triollm import LLM

    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"^model: path {re.escape(missing)} does not exist$"):
        EngineArgs(model=missing).create_engine_config()
    with pytest.raises(ValueError, match=r"^model: org/none is not a local directory"):
        LLM(model="org/none", download_dir=str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a model directory"):
        EngineArgs(model=str(tmp_path / "weights.bin")).create_engine_config()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^model: directory .* has no config.json"):
        EngineArgs(model=str(tmp_path / "empty")).create_engine_config()


def test_which_names_are_paths_and_which_are_hub_ids(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    (tmp_path / "org" / "local" / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert model_source_problem("org/local") is None  # an existing directory is local
    assert model_source_problem("triollm/tiny-demo") is None
    for path in ("./org/nope", "../nope", "/no/such/dir", "~/no-such-dir", "a/b/c",
                 "not a hub id"):
        assert model_source_problem(path) == f"path {path} does not exist"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    problem = model_source_problem("org/remote")
    assert problem is not None and "TRANSFORMERS_OFFLINE is set" in problem


def test_an_unreachable_hub_is_one_line_without_retries(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    import huggingface_hub

    def unreachable(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    assert model_source_problem("org/remote") is None  # only a probe asks the hub
    problem = model_source_problem("org/remote", probe_hub=True)
    assert problem == ("org/remote is not a local directory nor in the Hugging Face cache, "
                       "and the hub cannot be reached (ConnectionError: Name or service not "
                       "known); set HF_HUB_OFFLINE=1 to load only from the cache")


def test_the_bound_address_refuses_clients_until_the_server_serves_it() -> None:
    (fd,) = bind_listening_sockets("127.0.0.1", 0, None)
    with socket.socket(fileno=fd) as bound:
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(bound.getsockname())  # not queued for minutes: refused


@pytest.mark.parametrize(("host", "uds", "reason"), [
    ("no-such-host.invalid", None, "cannot listen on no-such-host.invalid:8000: unknown host"),
    ("192.0.2.1", None, "cannot listen on 192.0.2.1:8000: not an address of this machine"),
    ("127.0.0.1", "/no/such/dir/triollm.sock",
     "cannot listen on /no/such/dir/triollm.sock: no such file or directory"),
])
def test_an_address_it_cannot_listen_on_is_named(host: str, uds: str | None,
                                                 reason: str) -> None:
    with pytest.raises(ListenError) as raised:
        bind_listening_sockets(host, 8000, uds)
    assert str(raised.value).startswith(reason)


def test_a_port_taken_between_bind_and_listen_is_the_same_one_line() -> None:
    group = BaseExceptionGroup("server", [BaseExceptionGroup("hypercorn", [
        OSError(errno.EADDRINUSE, "Address already in use")])])
    found = listen_error(group)
    assert found is not None and "address already in use" in str(found)
    assert listen_error(BaseExceptionGroup("server", [RuntimeError("boom")])) is None


def test_the_server_serves_on_the_sockets_bound_before_the_model_loaded(
        llama_path: Path) -> None:
    from server_helpers import server_in_thread

    fds = bind_listening_sockets("127.0.0.1", 0, None)
    with socket.socket(fileno=os.dup(fds[0])) as view:
        port = view.getsockname()[1]
    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=64,
                           num_gpu_blocks_override=16)
    with server_in_thread(AsyncLLMEngine.from_engine_args(args), listen_fds=fds) as server:
        assert server.url == f"http://127.0.0.1:{port}"
        assert httpx.get(server.url + "/health").status_code == 200


def test_the_hub_is_asked_once_about_a_model_it_has(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    import huggingface_hub

    asked: list[str] = []

    def found(self: object, name: str, **kwargs: object) -> None:
        asked.append(name)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", found)
    name = f"org/found-{tmp_path.name}"
    for _ in range(2):  # the CLI's check, then the engine arguments'
        assert model_source_problem(name, probe_hub=True) is None
    assert asked == [name]
