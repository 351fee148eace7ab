"""A tokenizer worker process: long texts encoded, and chat templates a client controls
rendered, away from the server's interpreter.

Encoding a long text in a thread of the server's own process would still stall the
event loop: the tokenizer releases the GIL while it encodes, but making Python lists of
its result and freeing it (an object per token) hold the GIL in proportion to the text.
A worker process does all that on its own interpreter and sends back bytes, and only as
much as the caller can use: the count and the last ``keep`` ids, or the ids as JSON.

The parent side, ``TokenizerProcess``, is synchronous: a worker thread calls it and
waits on the pipe. The child (this file run by the server's Python) reads
pickled calls from stdin and writes pickled answers to stdout; it ends when its stdin
closes, so it never outlives the server.

It starts in a tenth of a second: where the server's tokenizer is a fast one whose
Rust tokenizer (``tokenizers``) encodes as it does (``fast_tokenizer_json`` checks on
probes), the child encodes with that alone, and unpickles the whole tokenizer, which
imports transformers (about 1.8 s of CPU), only before its first chat template
(``load_whole``: a call of its own, neither paced nor charged, as starting a worker is
not). A worker killed mid-call (its client left) is replaced at the next call; for
encoding, the replacement takes a tenth of a second of CPU, not 1.8 s.

It runs at the server's own priority: its work is what one client can make as large as
it likes, and what keeps it from the model's cores is its pace (server/worker_pace.py),
which stops and continues it so that it gets its client's share of one core. At a lower
priority a paced process would get less than that while the model computes (under
``SCHED_IDLE``, beside a 0.5B model on both cores, a paced 8 MB text that takes 8 s to
encode had not finished after five minutes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import select
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from typing import IO, Any

__all__ = ["CallFailed", "TokenizerProcess", "apply_chat_template", "check_body", "cpu_seconds",
           "encode_json", "encode_tail", "fast_tokenizer_json"]


def encode_tail(tokenizer: Any, text: str, add_special_tokens: bool, keep: int
                ) -> tuple[int, bytes]:
    """The number of tokens of ``text`` and its last ``keep`` ids (int64 bytes)."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return len(ids), array("q", ids[-keep:]).tobytes()


def encode_json(tokenizer: Any, text: str, add_special_tokens: bool) -> tuple[int, bytes]:
    """The number of tokens of ``text`` and its ids as a JSON list."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return len(ids), json.dumps(ids, separators=(",", ":")).encode()


def apply_chat_template(tokenizer: Any, conversation: list[dict[str, Any]],
                        arguments: dict[str, Any]) -> tuple[int, bytes]:
    """A conversation through the chat template (``chat_template_call``'s arguments):
    the text's length and the text (UTF-8)."""
    text = tokenizer.apply_chat_template(conversation, **arguments)
    return len(text), text.encode("utf-8", "surrogatepass")


def check_body(tokenizer: Any, body: bytes, max_items: int, max_chars: int
               ) -> tuple[int, bytes]:
    """server/body_text.py's ``body_problem`` of a request body, as JSON (``null``:
    none): decoding a large body here takes no GIL from the server."""
    del tokenizer
    return 0, json.dumps(_body_text().body_problem(body, max_items, max_chars)).encode()


def _body_text() -> Any:
    """body_text.py, loaded from its file: it needs the standard library only, and the
    package (torch with it) is not imported here."""
    module = sys.modules.get("triollm_body_text")
    if module is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "body_text.py")
        spec = importlib.util.spec_from_file_location("triollm_body_text", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["triollm_body_text"] = module
        spec.loader.exec_module(module)
    return module


def load_whole(tokenizer: Any) -> tuple[int, bytes]:
    """Unpickle the whole tokenizer now (for chat templates), if not done yet."""
    tokenizer.whole()
    return 0, b""


_CALLS: dict[str, Callable[..., tuple[int, bytes]]] = {
    "encode_tail": encode_tail, "encode_json": encode_json,
    "apply_chat_template": apply_chat_template, "check_body": check_body,
    "load_whole": load_whole}


_READY = "ready"


class CallFailed(RuntimeError):
    """The call raised in the worker (the process itself is fine)."""


class TokenizerProcess:
    """One worker process holding a copy of the server's tokenizer (sent pickled at
    start; the constructor returns once the process has loaded it). One call at a time;
    a broken process raises ``RuntimeError`` and is done.
    ``last_call_seconds``: the CPU time the last call took in the process."""

    def __init__(self, pickled_tokenizer: bytes, fast_json: str | None = None) -> None:
        """``pickled_tokenizer``: the server's tokenizer, pickled; ``fast_json``: its Rust
        tokenizer's JSON (``fast_tokenizer_json``), for encoding without it."""
        self.last_call_seconds = 0.0
        #: Whether the process holds the whole tokenizer (chat templates need it).
        self.whole_loaded = fast_json is None
        # the file itself, not the package (whose import the child has no use for).
        # -P: its folder is not put on sys.path. A process group of its own: should the
        # server die while the process is stopped (server/worker_pace.py), the group is
        # then orphaned, and the kernel continues it with a SIGHUP that ends it.
        self._process = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         process_group=0 if os.name == "posix" else None)
        self.broken = False
        # started before the first call: a call's time (paced, charged) is its own
        try:
            self._send((pickled_tokenizer, fast_json))
            assert self._process.stdout is not None
            ready = pickle.load(self._process.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as error:
            self.close()
            raise RuntimeError(f"the tokenizer process did not start: {error!r}") from error
        if ready != _READY:
            self.close()
            raise RuntimeError(f"the tokenizer process did not start: {ready!r}")

    @property
    def pid(self) -> int:
        return self._process.pid

    def _send(self, message: object) -> None:
        stdin = self._process.stdin
        assert stdin is not None
        pickle.dump(message, stdin, protocol=pickle.HIGHEST_PROTOCOL)
        stdin.flush()

    def call(self, name: str, *args: object,
             wait: Callable[[int, Callable[[float], bool]], None] | None = None) -> Any:
        """``name(tokenizer, *args)`` in the process (``encode_tail``, ``encode_json``
        or ``apply_chat_template``); ``CallFailed`` if it raised there. ``wait``, if
        given, is called with the process's pid and a function that waits up to so many
        seconds for the answer to start (True once it has): it returns when it has
        (server/worker_pace.py paces the process meanwhile); should it raise, the
        process is killed and the call raises that."""
        self.last_call_seconds = 0.0  # a call that breaks the process reports none
        try:
            self._send((name, args))
            assert self._process.stdout is not None
            if wait is not None:
                started = cpu_seconds(self.pid)
                try:
                    wait(self.pid, self._answer_started)
                except BaseException:
                    self.last_call_seconds = max(0.0, cpu_seconds(self.pid) - started)
                    self.kill()
                    raise
            ok, value, self.last_call_seconds = pickle.load(self._process.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as error:
            self.close()
            raise RuntimeError(f"the tokenizer process failed: {error!r}") from error
        if not ok:
            raise CallFailed(f"the tokenizer failed: {value}")
        return value

    def load_whole(self) -> None:
        """Have the process unpickle the whole tokenizer, if it has not (unpaced);
        ``RuntimeError`` where it cannot."""
        if self.whole_loaded:
            return
        try:
            self.call("load_whole")
        except CallFailed as error:
            self.kill()
            raise RuntimeError(f"the tokenizer process could not load the tokenizer: "
                               f"{error}") from error
        self.whole_loaded = True

    def _answer_started(self, timeout: float) -> bool:
        # poll, not select: the pipe's descriptor may be past select's 1023
        assert self._process.stdout is not None
        poller = select.poll()
        poller.register(self._process.stdout, select.POLLIN)
        return bool(poller.poll(max(0, round(timeout * 1000))))

    def kill(self) -> None:
        """End the process now, whatever it is doing."""
        self.broken = True
        self._process.kill()
        self.close()

    def close(self) -> None:
        """End the process (it exits when its stdin closes)."""
        self.broken = True
        if self._process.stdin is not None and not self._process.stdin.closed:
            try:
                self._process.stdin.close()
            except OSError:
                pass
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has used (0 where ``/proc`` cannot say)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fast_tokenizer_json(tokenizer: Any) -> str | None:
    """The JSON of ``tokenizer``'s Rust tokenizer where it encodes every probe (plain,
    Unicode, spaces, each special token) as ``tokenizer.encode`` does, with and without
    special tokens; None otherwise (a slow tokenizer, one that adds its own steps)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if not callable(to_str):
        return None
    try:
        text = to_str()
        fast = _fast_from(text)
        specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if isinstance(t, str)]
        probes = ["Hello, world!", "  the cat\n\n sat  on\tthe mat ", "ünïcödé 日本語 🙂 x",
                  "a" + "b".join(specials) + "c", " ".join(specials)]
        for probe in probes:
            for special in (True, False):
                if list(tokenizer.encode(probe, add_special_tokens=special)) != fast.encode(
                        probe, add_special_tokens=special).ids:
                    return None
    except Exception:  # any failure means: send the whole tokenizer only
        return None
    return str(text)


def _fast_from(text: str) -> Any:
    import tokenizers

    fast = tokenizers.Tokenizer.from_str(text)
    fast.no_truncation()
    fast.no_padding()
    return fast


class _Encoder:
    """The child's tokenizer: the Rust one where the server sent it, else the whole
    tokenizer, unpickled when first needed."""

    def __init__(self, pickled: bytes, fast_json: str | None) -> None:
        self._pickled = pickled
        self._whole: Any = None
        self._fast = None if fast_json is None else _fast_from(fast_json)
        if self._fast is None:
            self.whole()

    def whole(self) -> Any:
        if self._whole is None:
            self._whole = pickle.loads(self._pickled)  # the server's own, pickled by it
            self._pickled = b""
        return self._whole

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.whole().encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, conversation: list[dict[str, Any]], **arguments: Any
                            ) -> Any:
        return self.whole().apply_chat_template(conversation, **arguments)


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    pickled, fast_json = pickle.load(stdin)
    encoder = _Encoder(pickled, fast_json)
    pickle.dump(_READY, stdout)
    stdout.flush()
    while True:
        try:
            name, args = pickle.load(stdin)
        except EOFError:
            return
        started = time.process_time()
        value: object
        try:
            ok, value = True, _CALLS[name](encoder, *args)
        except Exception as error:
            ok, value = False, f"{type(error).__name__}: {error}"
        answer = (ok, value, time.process_time() - started)
        pickle.dump(answer, stdout, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.flush()


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
