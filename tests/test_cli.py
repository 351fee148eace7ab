"""`triollm serve`'s flags: vLLM's names and meanings, and a help text that reads well."""

from __future__ import annotations

import re

import pytest

from triollm.cli import build_parser, engine_args_from_namespace, server_options_from_namespace
from triollm.engine.args import AsyncEngineArgs

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
        "--allow-credentials", "--log-level", "warning", "--disable-log-stats"])
    namespace.model = namespace.model_tag
    engine = engine_args_from_namespace(namespace, AsyncEngineArgs)
    assert (engine.model, engine.max_model_len, engine.enable_prefix_caching,
            engine.scheduling_policy) == ("some/model", 512, False, "priority")
    options = server_options_from_namespace(namespace)
    assert options.served_model_names == ("a", "b")
    assert (options.host, options.port, options.api_key) == ("0.0.0.0", 9001, "k")
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
