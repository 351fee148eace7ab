"""Rewrite the flag and request-field tables of docs/migration.md from the code.

    python scripts/migration_tables.py

The rows come from ``triollm serve``'s parser, ``triollm.refused_flags`` and
``triollm.server.protocol.REFUSED_FIELDS``, for the vLLM names listed in
tests/vllm_serve_flags.txt and tests/vllm_request_fields.txt; the notes below say what
a row's help text does not. tests/test_cli.py checks that the guide has every row.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from triollm.cli import build_parser
from triollm.refused_flags import OLDER_VLLM_FLAGS, REFUSED_FLAGS, RefusedFlag
from triollm.server.protocol import REFUSED_FIELDS

ROOT = Path(__file__).resolve().parent.parent

DIFFERENT = {
    "--dtype": "honoured, except `float16`/`half` on CPU, which is refused (about 100x slower "
               "than bf16 there); `auto` picks bf16 where the CPU has it",
    "--tensor-parallel-size": "honoured on one machine: the model's layers sharded by "
                              "transformers' tensor-parallel plan over N ranks (mp child "
                              "processes or Ray actors); families without a plan, LoRA, "
                              "pooling models and quantized checkpoints are refused by name",
    "--gpu-memory-utilization": "honoured on CUDA; on CPU the KV cache takes "
                                "`--kv-cache-space-gb` (vLLM: `VLLM_CPU_KVCACHE_SPACE`)",
    "--uvicorn-log-level": "honoured as the log level of the server (hypercorn serves "
                           "the app, not uvicorn); `trace` is `debug`",
    "--disable-uvicorn-access-log": "honoured: the access log, one line per request written "
                                    "at its end (status, duration, tokens), is on by "
                                    "default as uvicorn's is in vLLM",
    "--disable-access-log-for-endpoints": "honoured: comma-separated paths (exact, as "
                                          "vLLM's filter) whose requests the access log "
                                          "leaves out",
    "--disable-log-stats": "honoured: no periodic stats line and no `vllm:` metrics, as "
                           "in vLLM",
    "--shutdown-timeout": "honoured as the grace in-flight requests get after SIGINT/SIGTERM "
                          "(same as triollm's `--shutdown-grace`, default 30 s)",
    "--scheduling-policy": "honoured: fcfs, priority, and triollm's slo (docs/scheduling.md)",
    "--log-level": "honoured (any case); Python logging's level for the whole server",
    "--enable-log-requests": "honoured: off by default as in vLLM; `--disable-log-requests` "
                             "(vLLM's older flag) still turns it off",
}
FIELD_NOTES = {
    "user": "accepted; recorded nowhere (vLLM does the same)",
    "parallel_tool_calls": "accepted: this server never produces tool calls",
    "tools": "honoured: shown to the chat template; only `tool_choice: \"none\"` is served",
    "tool_choice": "`none` honoured; anything else refused (no tool-call parser)",
    "response_format": "`{\"type\": \"text\"}` honoured; JSON modes refused (no structured output)",
    "structured_outputs": "refused (no structured output)",
    "suffix": "refused",
    "best_of": "honoured only as 1 or n; anything else refused (vLLM V1 dropped it too)",
    "logprobs": "honoured",
    "top_logprobs": "honoured; without `logprobs: true` refused, as OpenAI and vLLM do",
    "echo": "honoured (chat: the last assistant message starts the reply, as vLLM)",
    "prompt": "honoured: a string, a list of strings, token ids, lists of token ids",
    "messages": "honoured: string content or text parts (`--chat-template-content-format`); "
                "image, audio, video and unknown parts refused by type",
    "request_id": "honoured: the response's id; made unique inside the engine",
    "priority": "honoured under `--scheduling-policy priority`",
    "max_tokens": "honoured; left out, the model's `max_new_tokens`, else the rest of the "
                  "context (completions: 16, as vLLM)",
    "stop": "honoured",
    "add_special_tokens": "honoured",
    "chat_template": "honoured",
    "chat_template_kwargs": "honoured (reserved names such as `tokenize` refused)",
    "documents": "honoured: passed to the chat template",
    "return_token_ids": "honoured: `prompt_token_ids` and each choice's `token_ids` (streamed: "
                        "the prompt's in the first event, new tokens in each)",
    "return_tokens_as_token_ids": "honoured (also `--return-tokens-as-token-ids`)",
    "continue_final_message": "honoured; together with an explicit "
                              "`add_generation_prompt: true` refused",
}


def _names(listing: str) -> list[str]:
    text = (ROOT / "tests" / listing).read_text()
    return [line for line in text.split("\n") if line and not line.startswith("#")]


def _refusal(flag: str, refused: RefusedFlag) -> str:
    if refused.kind == "switch":
        return f"refused (`--no-{flag[2:]}` accepted): {refused.reason}"
    if refused.neutral:
        accepted = " or ".join(f"`{value}`" for value in refused.neutral)
        return f"refused unless {accepted}: {refused.reason}"
    return f"refused: {refused.reason}"


def older_flag_table() -> str:
    rows = ["| older vLLM flag | in triollm |", "| --- | --- |"]
    rows += [f"| `{flag}` | {_refusal(flag, refused)} |"
             for flag, refused in sorted(OLDER_VLLM_FLAGS.items())]
    return "\n".join(rows)


def flag_table() -> str:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,index]
    actions = {name: action for action in serve._actions for name in action.option_strings}
    rows = ["| vLLM flag | in triollm |", "| --- | --- |"]
    for flag in _names("vllm_serve_flags.txt"):
        refused = REFUSED_FLAGS.get(flag)
        if refused is not None:
            status = _refusal(flag, refused)
        elif flag in DIFFERENT:
            status = DIFFERENT[flag]
        else:
            help_text = re.sub(r"\s*\(default: .*\)$", "", actions[flag].help or "").strip()
            status = f"honoured: {help_text}"
        rows.append(f"| `{flag}` | {status.replace('|', '/')} |")
    return "\n".join(rows)


def _refused_field(name: str) -> str:
    neutral, reason = REFUSED_FIELDS[name]
    accepted = " or ".join(f"`{json.dumps(value)}`" for value in neutral)
    return f"refused unless {accepted}: {reason}"


def field_table() -> str:
    rows = ["| vLLM request field | in triollm |", "| --- | --- |"]
    for name in _names("vllm_request_fields.txt"):
        if name in REFUSED_FIELDS:
            status = _refused_field(name)
        else:
            status = FIELD_NOTES.get(name, "honoured")
        rows.append(f"| `{name}` | {status.replace('|', '/')} |")
    return "\n".join(rows)


POOLING_FIELD_NOTES = {
    "input": "honoured: a string, a list of strings, token ids, lists of token ids",
    "messages": "honoured: through the chat template (the request's `chat_template`, the "
                "server's or the tokenizer's)",
    "encoding_format": "`float` and `base64` honoured (vLLM's `bytes` forms refused)",
    "embed_dtype": "`float32` honoured; other dtypes refused",
    "endianness": "`native` and `little` honoured; `big` refused",
    "dimensions": "honoured for Matryoshka models (refused otherwise, as vLLM does)",
    "use_activation": "honoured: normalize embeddings; sigmoid / softmax for classifiers",
    "task": "honoured: `embed` or `classify`, which must be the model's",
    "truncate_prompt_tokens": "honoured: keeps the last tokens; -1 keeps `max_model_len`",
    "cache_salt": "accepted: pooling requests read and write no prefix cache",
    "user": "accepted; recorded nowhere (vLLM does the same)",
    "priority": "honoured under `--scheduling-policy priority`",
    "request_id": "honoured: the response's id; made unique inside the engine",
    "top_n": "honoured (0 or absent: every document)",
    "items": "honoured: the second side with `queries`",
    "documents": "honoured: `/score`'s second side with `queries`, `/rerank`'s documents "
                 "(strings or `{\"text\": ...}`); with `messages`, passed to the chat template",
}


def pooling_field_table() -> str:
    from triollm.server.protocol import (
        ClassificationRequest,
        PoolingRequest,
        RerankRequest,
        ScoreRequest,
    )

    fields = {name for model in (PoolingRequest, ClassificationRequest, ScoreRequest,
                                 RerankRequest) for name in model.model_fields}
    rows = ["| vLLM pooling request field | in triollm |", "| --- | --- |"]
    for name in _names("vllm_pooling_request_fields.txt"):
        if name in REFUSED_FIELDS:
            status = _refused_field(name)
        elif name in fields:
            status = POOLING_FIELD_NOTES.get(name, FIELD_NOTES.get(name, "honoured"))
        else:
            raise SystemExit(f"{name}: a vLLM pooling request field with no row: implement "
                             f"it or add it to REFUSED_FIELDS")
        rows.append(f"| `{name}` | {status.replace('|', '/')} |")
    return "\n".join(rows)


def main() -> None:
    path = ROOT / "docs" / "migration.md"
    doc = path.read_text()
    doc = re.sub(r"\| vLLM flag \| in triollm \|\n(\|.*\n)+", flag_table() + "\n", doc)
    doc = re.sub(r"\| older vLLM flag \| in triollm \|\n(\|.*\n)+", older_flag_table() + "\n",
                 doc)
    doc = re.sub(r"\| vLLM request field \| in triollm \|\n(\|.*\n)+", field_table() + "\n",
                 doc)
    doc = re.sub(r"\| vLLM pooling request field \| in triollm \|\n(\|.*\n)+",
                 pooling_field_table() + "\n", doc)
    path.write_text(doc)


if __name__ == "__main__":
    main()
