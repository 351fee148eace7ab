"""The tokenizer worker process (server/tokenizer_process.py) encodes with the Rust
tokenizer alone where it encodes as the server's tokenizer does, so that a replacement
for a worker killed mid-call starts cheaply, and loads the whole tokenizer only for its
first chat template."""

from __future__ import annotations

import array
import json
import pickle
from typing import Any

import psutil

from triollm.server.tokenizer_process import TokenizerProcess, fast_tokenizer_json
from triollm.testing import train_test_tokenizer

TEXTS = ["Hello, world!", "  the cat\n\n sat  on\tthe mat ", "ünïcödé 日本語 🙂", ""]


def _child_cpu(worker: TokenizerProcess) -> float:
    times = psutil.Process(worker.pid).cpu_times()
    return times.user + times.system


def test_a_fast_worker_encodes_as_the_tokenizer_and_starts_for_less() -> None:
    tokenizer = train_test_tokenizer()
    fast_json = fast_tokenizer_json(tokenizer)
    assert fast_json is not None
    pickled = pickle.dumps(tokenizer)
    fast, whole = TokenizerProcess(pickled, fast_json), TokenizerProcess(pickled)
    try:
        # the whole tokenizer imports transformers; the Rust one alone does not
        assert _child_cpu(fast) < 0.5 * _child_cpu(whole)
        text = " ".join(TEXTS * 50) + tokenizer.eos_token
        for special in (True, False):
            expected = tokenizer.encode(text, add_special_tokens=special)
            for worker in (fast, whole):
                count, data = worker.call("encode_json", text, special)
                assert count == len(expected) and json.loads(data) == expected
                count, tail = worker.call("encode_tail", text, special, 7)
                assert array.array("q", tail).tolist() == expected[-7:]
    finally:
        fast.close()
        whole.close()


def test_a_fast_worker_loads_the_whole_tokenizer_once_for_chat_templates() -> None:
    tokenizer = train_test_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    worker = TokenizerProcess(pickle.dumps(tokenizer), fast_tokenizer_json(tokenizer))
    try:
        assert not worker.whole_loaded
        before = _child_cpu(worker)
        worker.load_whole()
        loading = _child_cpu(worker) - before
        worker.load_whole()  # once
        assert worker.whole_loaded and _child_cpu(worker) - before < 1.5 * loading
        length, text = worker.call("apply_chat_template", [{"role": "user", "content": "hi"}],
                                    {"tokenize": False})
        assert text.decode() == "<hi>" and length == 4
    finally:
        worker.close()


class _Disagreeing:
    """A tokenizer whose own encode adds a step its Rust tokenizer does not."""

    def __init__(self) -> None:
        self.inner = train_test_tokenizer()
        self.backend_tokenizer = self.inner.backend_tokenizer
        self.all_special_tokens = self.inner.all_special_tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0, *self.inner.encode(text.lower(), add_special_tokens=add_special_tokens)]


def test_a_tokenizer_whose_rust_tokenizer_disagrees_is_sent_whole() -> None:
    assert fast_tokenizer_json(_Disagreeing()) is None
    assert fast_tokenizer_json(object()) is None
    plain: Any = type("Plain", (), {"encode": lambda self, text, **_: [1]})()
    assert fast_tokenizer_json(plain) is None
