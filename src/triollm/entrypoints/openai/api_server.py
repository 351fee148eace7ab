"""``python -m triollm.entrypoints.openai.api_server --model M ...``: the same server as
``triollm serve M ...`` (vLLM's ``python -m vllm.entrypoints.openai.api_server``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from triollm.cli import main as cli_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``triollm serve`` with these arguments."""
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
