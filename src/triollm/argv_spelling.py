"""vLLM's ways of writing a ``vllm serve`` command line, read the way vLLM reads them:
``--max_num_seqs`` for ``--max-num-seqs``, ``-O2`` for ``--optimization-level 2``,
``--config FILE.yaml`` for the flags in that file, ``32k`` for a token count."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence

__all__ = ["human_readable_int", "normalize_argv"]

#: vLLM's ``-O`` levels (``--optimization-level``).
_LEVELS = ("0", "1", "2", "3")


def human_readable_int(text: str) -> int:
    """``"32k"`` → 32000, ``"32K"`` → 32768, ``"1.5m"`` → 1500000 (vLLM's reading:
    lower case counts in thousands, upper case in powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 4k or 4K, got "
                                         f"{text!r}")
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1 if suffix else 0
    base = 1024 if suffix.isupper() else 1000
    if suffix.isupper() and "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary size (K, M, G) takes a whole "
                                         f"number")
    value = float(number) * base**power if "." in number else int(number) * base**power
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def _optimization_level(item: str, following: str | None) -> list[str]:
    """vLLM's ``-O`` shorthand for ``--optimization-level``: ``-O2``, ``-O=2`` or
    ``-O 2`` (``following`` is the word after a bare ``-O``). Its other forms set vLLM's
    compilation config, which triollm does not have."""
    level = following if item == "-O" else item[3:] if item.startswith("-O=") else item[2:]
    if level is not None and level in _LEVELS:
        return ["--optimization-level", level]
    shown = f"-O {following}" if item == "-O" and following is not None else item
    raise ValueError(f"{shown}: triollm takes only the optimization levels -O0 to -O3 "
                     f"(--optimization-level); vLLM's compilation settings "
                     f"(--compilation-config) have no counterpart")


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's spellings: ``--max_num_seqs`` is ``--max-num-seqs``, ``-O2`` (or ``-O 2``,
    ``-O=2``) is ``--optimization-level 2``, and ``--config FILE`` (a YAML mapping of
    flag names to values) is spliced in before the other flags, so the command line
    wins. Raises ``ValueError`` for an ``-O`` form triollm does not take."""
    args: list[str] = []
    config_files: list[str] = []
    items = iter(argv)
    for item in items:
        if item.startswith("-O"):
            following = next(items, None) if item == "-O" else None
            args.extend(_optimization_level(item, following))
            continue
        if item.startswith("--") and len(item) > 2:
            name, eq, value = item.partition("=")
            item = name.replace("_", "-") + eq + value
            if name.replace("_", "-") == "--config":
                config_files.append(value if eq else next(items, ""))
                continue
        args.append(item)
    if not config_files:
        return args
    spliced: list[str] = []
    for path in config_files:
        spliced.extend(_flags_from_yaml(path))
    # positional arguments (the subcommand, a model) must stay in front
    split = next((i for i, a in enumerate(args) if a.startswith("-")), len(args))
    return args[:split] + spliced + args[split:]


def _flags_from_yaml(path: str) -> list[str]:
    import yaml

    if not path:
        raise SystemExit("triollm: error: --config needs a YAML file")
    try:
        with open(path, encoding="utf-8") as file:
            mapping = yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError) as error:
        raise SystemExit(f"triollm: error: --config {path}: {error}") from None
    if not isinstance(mapping, dict):
        raise SystemExit(f"triollm: error: --config {path}: expected a mapping of flag "
                         f"names to values")
    flags: list[str] = []
    for key, value in mapping.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            flags.extend([flag, *(str(v) for v in value)])
        elif isinstance(value, dict):
            flags.extend([flag, json.dumps(value)])
        elif value is not None:
            flags.extend([flag, str(value)])
    return flags
