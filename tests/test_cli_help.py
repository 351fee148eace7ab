"""`triollm --help` and the docs tell the truth about the flags: one default per flag,
the one the engine resolves; every flag the docs name exists; `--version`; vLLM's
`-O` shorthand."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from triollm.cli import build_parser, engine_args_from_namespace, main, normalize_argv
from triollm.config import EngineConfig
from triollm.engine import args as engine_args
from triollm.engine.args import AsyncEngineArgs
from triollm.flag_help import ENGINE_FLAG_DEFAULTS, ENGINE_FLAG_HELP

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = re.compile(r"\(default: (.*)\)$", re.DOTALL)


def subcommand(name: str) -> argparse.ArgumentParser:
    commands = next(action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    return commands.choices[name]


def shown_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each flag's help as ``--help`` prints it (``%(default)s`` filled in), by dest."""
    formatter = parser._get_formatter()
    return {action.dest: formatter._expand_help(action) for action in parser._actions
            if action.help and action.help != argparse.SUPPRESS}


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_shows_at_most_one_default_per_flag(command: str) -> None:
    for dest, text in shown_help(subcommand(command)).items():
        assert len(re.findall(r"\bdefault\b", text)) <= 1, (dest, text)
        assert "(default: None)" not in text, dest


def test_help_defaults_are_the_engines() -> None:
    fields = {field.name: field for field in dataclasses.fields(AsyncEngineArgs)}
    shown = {dest: DEFAULT.search(text) for dest, text in
             shown_help(subcommand("serve")).items() if dest in fields}
    assert set(shown) == set(fields)
    words = {}
    for name, field in fields.items():
        match = shown[name]
        if name in ENGINE_FLAG_DEFAULTS or name == "optimization_level":
            assert match is not None, name
            words[name] = " ".join(match.group(1).split())
        elif field.default is None:
            assert match is None, name  # unset means off: nothing to show
        else:
            assert match is not None and match.group(1) == str(field.default), name
    config = AsyncEngineArgs().create_engine_config()
    demo = config.model
    assert words["model"].startswith(f"{AsyncEngineArgs.model},")
    assert words["optimization_level"] == str(engine_args.DEFAULT_OPTIMIZATION_LEVEL)
    assert demo.compile_model is (engine_args.DEFAULT_OPTIMIZATION_LEVEL > 0)
    assert words["tokenizer"] == "the model's" and demo.tokenizer == demo.model
    assert words["served_model_name"] == "--model" and demo.served_model_name == demo.model
    assert words["max_model_len"] == "the model's"
    assert demo.max_model_len == demo.hf_config.max_position_embeddings
    budget = int(words["max_num_batched_tokens"].split(";")[0])
    assert config.scheduler.max_num_batched_tokens == budget
    unchunked = _config(enable_chunked_prefill=False)
    assert unchunked.scheduler.max_num_batched_tokens == max(budget, demo.max_model_len)
    assert "off on CPU" in words["async_scheduling"]
    assert demo.device.type == "cpu" and config.scheduler.async_scheduling is False
    assert words["max_cpu_loras"] == "--max-loras"
    lora = _config(enable_lora=True, max_loras=3).lora
    assert lora is not None and lora.max_cpu_loras == 3
    assert words["structured_outputs_config"] == "backend auto"
    assert config.structured_outputs.backend == "auto"


def _config(**changes: Any) -> EngineConfig:
    return AsyncEngineArgs(**changes).create_engine_config()


def test_every_engine_flag_is_explained() -> None:
    fields = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    assert set(ENGINE_FLAG_HELP) == fields
    assert set(ENGINE_FLAG_DEFAULTS) <= fields
    assert not [name for name, text in ENGINE_FLAG_HELP.items()
                if re.search(r"\bdefault\b", text)]


def _flags_named_in(text: str) -> set[str]:
    """The flags in a document's inline code and in its triollm command lines."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    commands = [command for block in re.findall(r"```.*?```", text, flags=re.DOTALL)
                for line in block.splitlines() for command in line.split("&&")
                if "triollm" in command]
    found = set()
    for part in [*spans, *commands]:
        if part.split(maxsplit=1)[:1] in (["pip"], ["curl"], ["docker"]):
            continue
        found |= {flag.replace("_", "-") for flag in
                  re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9](?![\w-])", part)}
    return found


@pytest.mark.parametrize("document", ["docs/serving.md", "docs/api.md", "README.md"])
def test_every_flag_the_docs_name_exists(document: str) -> None:
    known = {option for parser in (build_parser(), subcommand("serve"),
                                   subcommand("generate"))
             for action in parser._actions for option in action.option_strings}
    named = _flags_named_in((ROOT / document).read_text())
    assert named, document
    assert sorted(named - known) == []


def test_enforce_eager_means_the_same_in_help_and_docs() -> None:
    help_text = " ".join(shown_help(subcommand("serve"))["enforce_eager"].split())
    serving = " ".join((ROOT / "docs" / "serving.md").read_text().split())
    assert f"`--enforce-eager` ({ENGINE_FLAG_HELP['enforce_eager']})" in serving
    api_row = next(line for line in (ROOT / "docs" / "api.md").read_text().splitlines()
                   if line.startswith("| `enforce_eager` |"))
    for fact in ("compile nothing", "SDPA", "fp32", "C kernel"):
        assert fact in help_text and fact in api_row, fact
    # what the runner does: no C decode kernel under enforce_eager, so an fp32 cache
    runner = (ROOT / "src" / "triollm" / "model" / "runners" / "torch_runner.py").read_text()
    assert "not model_config.enforce_eager else None" in runner
    assert "torch.float32 if on_cpu and cpu_kernel is None" in runner


def test_version_prints_the_installed_version() -> None:
    done = subprocess.run([sys.executable, "-m", "triollm", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert done.stdout.strip() == importlib.metadata.version("triollm")


@pytest.mark.parametrize(("argv", "level"), [
    (["-O0"], 0), (["-O3"], 3), (["-O", "2"], 2), (["-O=1"], 1),
    (["--optimization-level", "1"], 1), ([], None)])
def test_vllm_dash_o_sets_the_optimization_level(argv: list[str], level: int | None) -> None:
    namespace = build_parser().parse_args(normalize_argv(["serve", "m", *argv]))
    assert engine_args_from_namespace(namespace, AsyncEngineArgs).optimization_level == level


@pytest.mark.parametrize("form", [["-O.mode=3"], ["-O", '{"level": 3}'], ["-O4"], ["-O"]])
def test_vllm_compilation_config_forms_of_dash_o_are_refused_naming_it(
        form: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "m", *form]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"triollm: error: {' '.join(form)}: ")
    assert "-O0 to -O3" in error and "--compilation-config" in error
