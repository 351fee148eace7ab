"""`triollm serve`'s flags: vLLM's names and meanings, and a help text that reads well."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from triollm.cli import (
    build_parser,
    engine_args_from_namespace,
    human_readable_int,
    normalize_argv,
    server_options_from_namespace,
)
from triollm.engine.args import AsyncEngineArgs
from triollm.refused_flags import OLDER_VLLM_FLAGS, REFUSED_FLAGS

#: The flags the server issue asks for, spelled as `vllm serve` spells them.
VLLM_FLAGS = [
    "--model", "--tokenizer", "--served-model-name", "--host", "--port", "--api-key",
    "--dtype", "--device", "--max-model-len", "--block-size", "--max-num-seqs",
    "--max-num-batched-tokens", "--enable-chunked-prefill", "--enable-prefix-caching",
    "--gpu-memory-utilization", "--tensor-parallel-size", "--trust-remote-code",
    "--enforce-eager", "--seed", "--disable-log-requests", "--disable-log-stats",
    "--max-log-len", "--scheduling-policy", "--uvicorn-log-level", "--log-level",
    "--ssl-keyfile", "--ssl-certfile", "--allowed-origins", "--allow-credentials",
    "--allowed-methods", "--allowed-headers",
]


def test_serve_help_lists_every_vllm_flag_with_an_explanation(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for flag in VLLM_FLAGS:
        assert flag in text, flag
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    unexplained = [action.option_strings for action in serve._actions
                   if not re.sub(r"\(default: .*\)$", "", action.help or "").strip()]
    assert unexplained == []


def test_serve_flags_map_onto_engine_and_server_options() -> None:
    namespace = build_parser().parse_args([
        "serve", "some/model", "--served-model-name", "a", "b", "--port", "9001",
        "--api-key", "k", "--max-model-len", "512", "--no-enable-prefix-caching",
        "--scheduling-policy", "priority", "--allowed-origins", '["https://app.example"]',
        "--allow-credentials", "--log-level", "warning", "--disable-log-stats",
        "--optimization-level", "0"])
    namespace.model = namespace.model_tag
    engine = engine_args_from_namespace(namespace, AsyncEngineArgs)
    assert (engine.model, engine.max_model_len, engine.enable_prefix_caching,
            engine.scheduling_policy, engine.optimization_level) == (
        "some/model", 512, False, "priority", 0)
    options = server_options_from_namespace(namespace)
    assert options.served_model_names == ("a", "b")
    assert (options.host, options.port, options.api_key) == ("0.0.0.0", 9001, ("k",))
    assert options.cors.allowed_origins == ("https://app.example",)
    assert options.cors.allow_credentials and options.cors.allowed_methods == ("*",)
    assert options.log_level == "warning" and options.log_stats_interval is None


def test_defaults_are_vllms() -> None:
    namespace = build_parser().parse_args(["serve"])
    options = server_options_from_namespace(namespace)
    assert options.host == "0.0.0.0" and options.port == 8000  # vLLM binds every interface
    assert options.cors.allowed_origins == ("*",) and not options.cors.allow_credentials
    assert options.log_level == "info" and options.log_stats_interval == 10.0


def test_a_bad_json_list_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--allowed-origins", "https://app.example"])
    assert exited.value.code == 2
    assert "JSON list" in capsys.readouterr().err


def parse(*argv: str) -> tuple[AsyncEngineArgs, Any]:
    namespace = build_parser().parse_args(normalize_argv(["serve", *argv]))
    if namespace.model_tag is not None:
        namespace.model = namespace.model_tag
    engine = engine_args_from_namespace(namespace, AsyncEngineArgs)
    assert isinstance(engine, AsyncEngineArgs)
    return engine, server_options_from_namespace(namespace)


def test_underscores_human_readable_sizes_and_several_keys() -> None:
    engine, options = parse("m", "--max_num_seqs", "7", "--max-model-len", "1k",
                            "--max_num_batched_tokens=2K", "--api-key", "a", "b",
                            "--enable-log-requests", "--log-level", "WARNING")
    assert (engine.max_num_seqs, engine.max_model_len, engine.max_num_batched_tokens) == (
        7, 1000, 2048)
    assert options.api_key == ("a", "b") and engine.enable_log_requests
    assert options.log_level == "warning"
    assert [human_readable_int(t) for t in ("4096", "32k", "32K", "1.5m", "1M")] == [
        4096, 32000, 32768, 1_500_000, 1_048_576]
    for bad in ("1.5K", "abc", "0.0001k"):
        with pytest.raises(argparse.ArgumentTypeError):
            human_readable_int(bad)


def test_config_file_flags_with_the_command_line_winning(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 9\nmax-model-len: 2k\nenable-prefix-caching: false\n"
                      "api-key: [x, y]\nport: 9100\n"
                      "override_generation_config: {temperature: 0.5}\n")
    engine, options = parse("m", "--config", str(config), "--port", "9200")
    assert (engine.model, engine.max_num_seqs, engine.max_model_len,
            engine.enable_prefix_caching) == ("m", 9, 2000, False)
    assert json.loads(str(engine.override_generation_config)) == {"temperature": 0.5}
    assert options.api_key == ("x", "y") and options.port == 9200


def test_server_flags_reach_the_server_options() -> None:
    engine, options = parse(
        "--uds", "/tmp/t.sock", "--root-path", "/api", "--disable-uvicorn-access-log",
        "--disable-fastapi-docs", "--chat-template-content-format", "openai",
        "--return-tokens-as-token-ids", "--shutdown-timeout", "5", "--revision", "v2",
        "--download-dir", "/tmp/hub", "--generation-config", "vllm")
    assert (options.uds, options.root_path, options.access_log, options.api_docs) == (
        "/tmp/t.sock", "/api", False, False)
    assert options.chat_template_content_format == "openai"
    assert options.return_tokens_as_token_ids and options.shutdown_grace == 5
    assert (engine.revision, engine.download_dir, engine.generation_config) == (
        "v2", "/tmp/hub", "vllm")


def test_every_vllm_flag_is_known() -> None:
    """Each flag of `vllm serve` (vLLM 0.32) is a triollm flag or a refused one."""
    listed = Path(__file__).with_name("vllm_serve_flags.txt").read_text().split("\n")
    flags = [line for line in listed if line.startswith("--")]
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    known = {name for action in serve._actions for name in action.option_strings}
    assert len(flags) > 300
    assert [flag for flag in flags if flag not in known] == []
    assert set(REFUSED_FLAGS) <= set(flags)


@pytest.mark.parametrize(("argv", "message"), [
    (["--quantization-config", "{}"], "--quantization-config {}: not supported by triollm"),
    (["--kv-cache-dtype-skip-layers", "0"], "every layer's KV cache is kept in"),
    (["--fully-sharded-loras"], "--fully-sharded-loras: not supported by triollm: this LoRA"),
    (["--pipeline-parallel-size", "2"], "no pipeline, context or expert parallelism"),
    (["--lora-modules", "a/x"], "expected name=path or a JSON object"),
    (["--enable-layerwise-nvtx-tracing"], "NVTX and trace-replay tracing are not supported"),
    (["--swap-space", "16"], "--swap-space 16: not supported by triollm: triollm never swaps"),
    (["--use-v2-block-manager"], "removed from vLLM since"),
])
def test_vllm_flags_that_do_not_apply_fail_saying_why(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(*argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_vllm_flags_that_ask_for_what_triollm_does_are_accepted() -> None:
    engine, _ = parse("m", "--kv-cache-dtype", "auto", "--pipeline-parallel-size", "1",
                      "--no-enable-lora", "--load-format", "safetensors", "--runner",
                      "generate", "--model-impl", "transformers", "--swap-space", "0",
                      "--task", "generate")
    assert engine.model == "m"


def test_lora_flags_reach_the_engine_and_the_server() -> None:
    engine, options = parse(
        "m", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras",
        "8", "--lora-dtype", "float32", "--lora-target-modules", "q_proj", "v_proj",
        "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", '
        '"base_model_name": "m"}')
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras,
            engine.lora_dtype, engine.lora_target_modules) == (
        True, 4, 32, 8, "float32", ["q_proj", "v_proj"])
    assert [(m.name, m.path, m.base_model_name) for m in options.lora_modules] == [
        ("sql", "/a/sql", None), ("chat", "/a/chat", "m")]


def test_vllm_module_path_runs_the_same_server() -> None:
    done = subprocess.run([sys.executable, "-m", "triollm.entrypoints.openai.api_server",
                           "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--max-model-len" in done.stdout
    assert "usage: triollm serve" in done.stdout


def test_the_migration_guide_has_a_row_for_every_vllm_flag_and_field() -> None:
    root = Path(__file__).parent
    guide = (root.parent / "docs" / "migration.md").read_text()
    for listing in ("vllm_serve_flags.txt", "vllm_request_fields.txt",
                    "vllm_pooling_request_fields.txt"):
        names = [line for line in (root / listing).read_text().split("\n")
                 if line and not line.startswith("#")]
        missing = [name for name in names if f"| `{name}` |" not in guide]
        assert missing == [], listing
    assert [flag for flag in OLDER_VLLM_FLAGS if f"| `{flag}` |" not in guide] == []
    assert "ignored |" not in guide


def test_tracing_flags_reach_the_engine_arguments() -> None:
    engine, _ = parse("m", "--otlp-traces-endpoint", "http://collector:4318/v1/traces",
                      "--collect-detailed-traces", "model,worker")
    assert engine.otlp_traces_endpoint == "http://collector:4318/v1/traces"
    assert engine.collect_detailed_traces == ["model,worker"]
    engine, options = parse("m", "--disable-log-stats")
    assert engine.disable_log_stats and options.log_stats_interval is None


def test_async_scheduling_flags_reach_the_engine_config() -> None:
    cpu = {"model": "triollm/tiny-demo", "device": "cpu"}
    engine, _ = parse("m", "--async-scheduling")
    assert engine.async_scheduling is True
    assert dataclasses.replace(engine, **cpu).create_engine_config().scheduler.async_scheduling
    engine, _ = parse("m", "--no-async-scheduling")
    assert engine.async_scheduling is False
    engine, _ = parse("m")
    assert engine.async_scheduling is None
    # The default: off on CPU, where the model's threads take every core.
    config = dataclasses.replace(engine, **cpu).create_engine_config()
    assert config.scheduler.async_scheduling is False


def test_llm_refuses_async_scheduling_naming_it() -> None:
    from triollm import LLM

    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(async_scheduling=True)


def test_tool_and_reasoning_flags_reach_the_server_and_the_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine, options = parse("m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                            "--reasoning-parser", "qwen3", "--enable-reasoning")
    assert (options.enable_auto_tool_choice, options.tool_call_parser) == (True, "hermes")
    assert engine.reasoning_parser == "qwen3"
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from triollm.tool_parsers import ToolParser, ToolParserManager\n"
        "@ToolParserManager.register_module('my_calls')\n"
        "class MyCalls(ToolParser):\n    pass\n")
    _, options = parse("m", "--tool-parser-plugin", str(plugin), "--tool-call-parser",
                       "my_calls", "--enable-auto-tool-choice")
    assert options.tool_call_parser == "my_calls"
    from triollm.cli import main

    for argv, named in [
            (["--tool-call-parser", "nope"], "nope"),
            (["--enable-auto-tool-choice"], "--tool-call-parser"),
            (["--enable-reasoning"], "--reasoning-parser"),
            (["--tool-parser-plugin", str(tmp_path / "missing.py")], "missing.py")]:
        assert main(["serve", "m", *argv]) == 2
        assert named in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"reasoning_parser.*nope"):
        AsyncEngineArgs(model="m", reasoning_parser="nope").create_engine_config()


def test_tool_flags_vllm_does_not_build_here_are_refused_with_the_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--tool-server", "--tool-strict-level"):
        with pytest.raises(SystemExit) as exited:
            parse("m", flag, "x")
        assert exited.value.code == 2
        assert "not supported by triollm" in capsys.readouterr().err
