"""``triollm`` command line. Engine flags are generated from ``EngineArgs`` with vLLM's
spelling (``--max-model-len``), so every subcommand takes the same engine options."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from triollm.config import EngineArgs

__all__ = ["add_engine_arguments", "engine_args_from_namespace", "main"]

_HELP = {
    "model": "model directory or hub id (default: the built-in demo model, random weights)",
    "tokenizer": "tokenizer directory or hub id (default: the model's)",
    "dtype": "auto (bf16 on CUDA or a bf16-capable CPU, else fp32), bfloat16, float32",
    "device": "auto, cpu or cuda",
    "max_num_batched_tokens": "token budget of one engine step",
    "num_gpu_blocks_override": "fix the number of KV-cache blocks on any device",
    "kv_cache_space_gb": "KV-cache memory on CPU, in GiB",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        help_text = _HELP.get(field.name, "") + f" (default: {field.default})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=field.default, help=help_text)
            continue
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        base = options[0] if isinstance(kind, types.UnionType) and options else kind
        if base not in (int, float, str):
            base = str
        parser.add_argument(flag, type=base, default=field.default, help=help_text)


def engine_args_from_namespace(namespace: argparse.Namespace) -> EngineArgs:
    names = {field.name for field in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(namespace).items() if k in names})


def _generate(namespace: argparse.Namespace) -> int:
    from triollm import LLM, SamplingParams

    args = engine_args_from_namespace(namespace)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(max_tokens=namespace.max_tokens, temperature=namespace.temperature,
                            seed=namespace.sampling_seed)
    for output in llm.generate(namespace.prompt, params, use_tqdm=len(namespace.prompt) > 1):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triollm", description="LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate offline for a few prompts")
    generate.add_argument("prompt", nargs="+", help="one or more prompts")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--sampling-seed", type=int, default=None)
    add_engine_arguments(generate)
    namespace = parser.parse_args(argv)
    try:
        handler: Any = {"generate": _generate}[namespace.command]
        return int(handler(namespace))
    except ValueError as error:
        print(f"triollm: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
