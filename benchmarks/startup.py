"""Start-up: from launching ``serve`` to the first answered request, triollm beside vLLM's
CPU build in one run, cold and warm, and how slow the first minute's requests are.

For each model and engine the server is started twice in a row:

* ``cold``: every compile cache empty. Each engine gets fresh directories for
  ``TORCHINDUCTOR_CACHE_DIR``, ``XDG_CACHE_HOME``, ``TRIOLLM_CACHE`` (triollm's C kernels
  and whatever else it keeps there are rebuilt: a restart must not depend on a cache a
  fresh install lacks) and ``VLLM_CACHE_ROOT`` (vLLM's torch.compile cache and model
  inspection cache; its C++ kernels come built in its wheel);
* ``warm``: started again at once with the caches the cold start left.

Timed from just before the process is launched: when the port first accepts a
connection, when ``/health`` first answers 200, and when the first completion (4 tokens,
greedy, sent once ``/health`` answers) comes back: the time to first answer. Then, for
``--profile-seconds``, one client sends a fixed request (a 32-token prompt, 64 output
tokens, ``ignore_eos``) back to back and records each latency against the time since
launch; and after that, once the server's log says its compiled forward is in use
(``COMPILED`` below, waited for up to ``--compile-wait`` seconds), ``--steady-requests``
more, whose median is the steady state. Reported: the latency of the first of those
requests, the worst and the median of the first ``--profile-seconds``, and each
``--bucket-seconds`` bucket's median, as ratios to the steady state.

The models: ``demo`` (triollm's built-in ``triollm/tiny-demo``; vLLM loads the same
config, tokenizer and random weights saved to a directory) and ``0.5b`` (Qwen2.5-0.5B's
shape, random bf16 weights, a 32,000-token byte-level BPE tokenizer). Both engines run
with ``--dtype`` (bfloat16 unless told), ``--max-model-len 1024``, ``--max-num-seqs 64``
and a KV cache of ``--kv-cache-gb`` GiB (``--kv-cache-space-gb`` /
``VLLM_CPU_KVCACHE_SPACE``); everything else at each engine's defaults (vLLM on a
2-core machine computes on one core and keeps the other for its front-end process).

While each start runs, vs_vllm.py's ``LoadSampler`` records how many cores the rest of
the machine kept busy; a figure measured while others used more than a tenth of a core
is marked contaminated. The servers run in process groups of their own, killed on exit
whatever happens; each server's output is kept, every line stamped with the seconds
since launch, in ``--work``.

    python benchmarks/startup.py                          # both models, both engines
    python benchmarks/startup.py --models demo --engines triollm --profile-seconds 30
    python benchmarks/startup.py --work /tmp/startup --json /tmp/startup/result.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from vs_vllm import (
    ANCHOR,
    CONTAMINATED_CORES,
    LoadSampler,
    free_port,
    offline_env,
    platform_line,
)

MODELS = ("demo", "0.5b")
ENGINES = ("triollm", "vllm")
#: Log lines saying the engine now runs its compiled forward: triollm's background
#: compile announces the switch; a triollm that compiles before serving says when it is
#: done. vLLM compiles before it serves and its first answer already uses the result.
COMPILED = re.compile(r"compiled forward in use|compiled the model in")
#: A log line saying the compile failed, so the model stays eager: stop waiting.
COMPILE_FAILED = re.compile(r"compiling the model failed")
SERVED_NAME = "bench"
PROMPT = "one two three four five six seven eight " * 4
#: Qwen2.5-0.5B's shape (its vocabulary replaced by a 32k one).
QWEN_05B: dict[str, Any] = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
VOCAB_32K = 32000


# ------------------------------------------------------------------------------- models

def pair_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens, built without
    training: the special tokens, the 256 byte symbols, then merges of byte pairs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*specials, *alphabet])}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) == vocab_size:
                break
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def save_model(name: str, directory: Path) -> None:
    """Save ``name``'s random bf16 weights (seed 0), config and tokenizer."""
    import torch
    import transformers

    if name == "demo":
        from triollm.model.loader import build_demo_tokenizer, demo_config

        config, tokenizer = demo_config(), build_demo_tokenizer()
    else:
        tokenizer = pair_tokenizer(VOCAB_32K)
        config = transformers.Qwen2Config(vocab_size=VOCAB_32K, bos_token_id=1,
                                          eos_token_id=2, **QWEN_05B)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def model_dirs(models: list[str], work: Path) -> dict[str, Path]:
    """Each model's directory under ``work``, saved unless a previous run saved it."""
    dirs = {}
    for name in models:
        directory = work / "models" / name
        if not (directory / "config.json").is_file():
            print(f"saving the {name} model to {directory}", flush=True)
            save_model(name, directory)
        dirs[name] = directory
    return dirs


# ------------------------------------------------------------------------------- server

@dataclass
class Start:
    """One server start, times in seconds since its launch."""

    engine: str
    model: str
    phase: str
    port_s: float | None = None
    health_s: float | None = None
    answer_s: float | None = None
    compiled_s: float | None = None
    #: (seconds since launch when sent, latency) of each profile request, in order.
    profile: list[tuple[float, float]] = field(default_factory=list)
    steady: list[float] = field(default_factory=list)
    start_others_cores: float = 0.0
    profile_others_cores: float = 0.0
    log: str = ""
    error: str | None = None

    @property
    def steady_s(self) -> float:
        return statistics.median(self.steady) if self.steady else float("nan")

    @property
    def contaminated(self) -> bool:
        return max(self.start_others_cores, self.profile_others_cores) > CONTAMINATED_CORES


class Server:
    """A ``serve`` process in a process group of its own; its output is stamped with the
    seconds since launch and written to ``log``, and watched for ``COMPILED``."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.compiled_s: float | None = None
        self.compile_failed = False
        self.lines: list[str] = []
        self.launched = time.monotonic()
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        assert self.process.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout,),
                                        daemon=True)
        self._reader.start()

    def since(self) -> float:
        return time.monotonic() - self.launched

    def _read(self, output: IO[str]) -> None:
        with open(self.log, "w") as file:
            file.write("# " + " ".join(self.process.args) + "\n")  # type: ignore[arg-type]
            for line in output:
                now = self.since()
                if self.compiled_s is None and COMPILED.search(line):
                    self.compiled_s = now
                self.compile_failed = self.compile_failed or bool(COMPILE_FAILED.search(line))
                self.lines.append(line)
                file.write(f"[{now:8.3f}] {line}")
                file.flush()

    def tail(self) -> str:
        return "".join(self.lines[-15:])

    def stop(self) -> None:
        """SIGTERM to the server (as an operator stops it: its children, a compiler among
        them, are its to stop), SIGKILL to its whole group after 90 s or once it exited,
        so nothing it started outlives the benchmark."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(90)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while _group_alive(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._reader.join(10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def command_for(engine: str, model: str, directory: Path, port: int,
                args: argparse.Namespace) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
              "--max-model-len", "1024", "--max-num-seqs", "64",
              "--served-model-name", SERVED_NAME]
    if engine == "vllm":
        return [args.vllm_python, str(ANCHOR / "vllm_cli.py"), "serve", str(directory),
                *common]
    source = "triollm/tiny-demo" if model == "demo" else str(directory)
    return [sys.executable, "-m", "triollm", "serve", source, *common,
            "--kv-cache-space-gb", str(args.kv_cache_gb), *args.triollm_arg]


def env_for(engine: str, caches: Path, args: argparse.Namespace) -> dict[str, str]:
    env = {**offline_env(), "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "XDG_CACHE_HOME": str(caches / "xdg")}
    if engine == "vllm":
        env.update(VLLM_CACHE_ROOT=str(caches / "vllm"),
                   VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gb))
    else:
        env["TRIOLLM_CACHE"] = str(caches / "triollm")
    return env


# ------------------------------------------------------------------------------ client

def completion(url: str, max_tokens: int, timeout: float) -> float:
    """Send one completion and wait for it; its latency in seconds."""
    body = json.dumps({"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        reply = json.load(response)
    if reply["usage"]["completion_tokens"] != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {reply['usage']}")
    return time.monotonic() - start


def wait_first_answer(server: Server, port: int, start: Start, timeout: float) -> None:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    last_error = "none"
    while start.answer_s is None:
        if server.process.poll() is not None:
            raise RuntimeError(f"{start.engine} exited ({server.process.returncode}):\n"
                               + server.tail())
        if time.monotonic() > deadline:
            raise RuntimeError(f"{start.engine}: no answer within {timeout:.0f} s (last "
                               f"error: {last_error})")
        if start.port_s is None:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=1):
                start.port_s = server.since()
        if start.port_s is not None and start.health_s is None:
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    url + "/health", timeout=2) as response:
                if response.status == 200:
                    start.health_s = server.since()
        if start.health_s is not None:
            try:
                completion(url, 4, max(1.0, deadline - time.monotonic()))
                start.answer_s = server.since()
            except OSError as error:  # refused, reset, or an error status while starting
                last_error = repr(error)
        if start.answer_s is None:
            time.sleep(0.05)


def profile(server: Server, port: int, start: Start, args: argparse.Namespace) -> None:
    url = f"http://127.0.0.1:{port}"
    until = server.since() + args.profile_seconds
    give_up = until + args.compile_wait
    while True:
        now = server.since()
        if now >= until and (start.engine == "vllm" or server.compiled_s is not None
                             or server.compile_failed or now >= give_up):
            break
        start.profile.append((now, completion(url, args.max_tokens, 600)))
    if start.engine == "triollm" and server.compiled_s is None:
        return  # still eager: there is no steady state to measure
    start.steady = [completion(url, args.max_tokens, 600)
                    for _ in range(args.steady_requests)]


def run_start(engine: str, model: str, phase: str, directory: Path, caches: Path,
              args: argparse.Namespace) -> Start:
    port = free_port()
    start = Start(engine, model, phase, log=str(args.work / f"{engine}-{model}-{phase}.log"))
    sampler = LoadSampler(set())
    server = Server(command_for(engine, model, directory, port, args),
                    env_for(engine, caches, args), Path(start.log))
    try:
        wait_first_answer(server, port, start, args.start_timeout)
        start.start_others_cores = sampler.others_cores()
        sampler = LoadSampler(set())
        profile(server, port, start, args)
        start.profile_others_cores = sampler.others_cores()
    except (RuntimeError, OSError) as error:
        start.error = str(error)
        print(f"{engine} {model} {phase} failed: {error}", flush=True)
    finally:
        server.stop()
    start.compiled_s = server.compiled_s
    return start


# ----------------------------------------------------------------------------- reports

def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def seconds(value: float | None) -> str:
    """Seconds to one decimal; ``n/a`` for what never happened."""
    return f"{value:.1f}" if value is not None else "n/a"


def load_flag(start: Start) -> str:
    return (f" (others {start.start_others_cores:.2f}/{start.profile_others_cores:.2f} "
            "cores: contaminated)") if start.contaminated else ""


def print_start(start: Start) -> None:
    print(f"{start.engine} {start.model} {start.phase}: first answer "
          f"{seconds(start.answer_s)} s (port {seconds(start.port_s)}, /health "
          f"{seconds(start.health_s)}, compiled in use {seconds(start.compiled_s)}); "
          f"steady {start.steady_s:.3f} s; others {start.start_others_cores:.2f}/"
          f"{start.profile_others_cores:.2f} cores", flush=True)


def print_report(starts: list[Start], args: argparse.Namespace) -> None:
    by_key = {(s.engine, s.model, s.phase): s for s in starts}
    print("\n| model | start | engine | port s | /health s | first answer s | "
          "compiled in use s | triollm / vLLM (first answer) |")
    print("|---" * 8 + "|")
    for s in starts:
        other = by_key.get(("vllm", s.model, s.phase))
        versus = ratio(s.answer_s, other.answer_s) if s.engine == "triollm" and other \
            else ""
        print(f"| {s.model} | {s.phase} | {s.engine} | {seconds(s.port_s)} | "
              f"{seconds(s.health_s)} | {'failed' if s.error else seconds(s.answer_s)}"
              f"{load_flag(s)} | "
              f"{seconds(s.compiled_s)} | {versus} |")
    print(f"\nlatency of one {args.max_tokens}-token request after the first answer, as a "
          "ratio to the steady state (the median of the requests after the profile):")
    print("| model | start | engine | steady s | first | worst | median | "
          f"per {args.bucket_seconds:.0f} s from the first answer |")
    print("|---" * 8 + "|")
    for s in starts:
        if not s.profile:
            continue
        latencies = [latency for _, latency in s.profile]
        if not s.steady:
            print(f"| {s.model} | {s.phase} | {s.engine} | compiled forward never in use: "
                  f"eager latency first {latencies[0]:.2f} s, median "
                  f"{statistics.median(latencies):.2f} s, worst {max(latencies):.2f} s"
                  f"{load_flag(s)} | | | | |")
            continue
        buckets: dict[int, list[float]] = {}
        for sent, latency in s.profile:
            buckets.setdefault(int((sent - (s.answer_s or 0)) // args.bucket_seconds),
                               []).append(latency)
        steady = s.steady_s
        series = " ".join(f"{statistics.median(v) / steady:.2f}"
                          for _, v in sorted(buckets.items()))
        print(f"| {s.model} | {s.phase} | {s.engine} | {steady:.3f}{load_flag(s)} | "
              f"{latencies[0] / steady:.2f}x | {max(latencies) / steady:.2f}x | "
              f"{statistics.median(latencies) / steady:.2f}x | {series} |")
    print("\nothers' CPU (cores) during start / profile: " + ", ".join(
        f"{s.engine} {s.model} {s.phase} {s.start_others_cores:.2f}/"
        f"{s.profile_others_cores:.2f}" for s in starts))


# -------------------------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--phases", nargs="+", default=["cold", "warm"],
                        choices=["cold", "warm"],
                        help="warm alone reuses the caches of --work's last cold start")
    parser.add_argument("--profile-seconds", type=float, default=60.0,
                        help="how long to send the fixed request after the first answer")
    parser.add_argument("--compile-wait", type=float, default=600.0,
                        help="after the profile, the most seconds to wait for triollm's "
                             "log to say its compiled forward is in use")
    parser.add_argument("--steady-requests", type=int, default=5)
    parser.add_argument("--bucket-seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="output tokens of the profile's fixed request")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="what both engines compute in")
    parser.add_argument("--kv-cache-gb", type=int, default=4,
                        help="KV-cache GiB for each engine")
    parser.add_argument("--start-timeout", type=float, default=1200.0,
                        help="seconds a start may take to its first answer")
    parser.add_argument("--triollm-arg", action="append", default=[],
                        help="one more argument for triollm serve (repeat for more)")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the models, caches and server logs go (kept; the "
                             "models are reused); default: a temporary directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the results")
    parser.add_argument("--vllm-python", default=None,
                        help="the side venv's python (default: run the anchor's setup.sh)")
    return parser.parse_args()


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def work_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="startup-") as temporary:
        yield Path(temporary)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    if "vllm" in args.engines and args.vllm_python is None:
        args.vllm_python = subprocess.run(["bash", str(ANCHOR / "setup.sh")], check=True,
                                          capture_output=True, text=True).stdout.strip()
    print(f"{os.cpu_count()} CPUs; {platform_line()}", flush=True)
    starts: list[Start] = []
    with work_dir(args.work) as work:
        args.work = work
        dirs = model_dirs(args.models, work)
        try:
            for model in args.models:
                for engine in args.engines:
                    caches = work / "caches" / f"{engine}-{model}"
                    for phase in args.phases:
                        if phase == "cold":
                            shutil.rmtree(caches, ignore_errors=True)
                        caches.mkdir(parents=True, exist_ok=True)
                        start = run_start(engine, model, phase, dirs[model], caches, args)
                        starts.append(start)
                        print_start(start)
        finally:  # interrupted too: report what was measured
            print_report(starts, args)
            if args.json is not None:
                args.json.write_text(json.dumps([asdict(s) for s in starts], indent=1))


if __name__ == "__main__":
    main()
