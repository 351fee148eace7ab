"""The ``triollm::`` torch ops: the calls a compiled model cannot trace into (the packed
linear layers, paged attention), each an opaque op with a fake for tracing.

They are defined with ``torch.library``'s low-level API rather than
``torch.library.custom_op``, whose Python wrappers around each call (an aliasing check
of the output against the inputs, a context that keeps dynamo out of the body) double
the cost of calling an empty op, and a decode step makes several such calls per layer
(docs/benchmarks.md). The ops return new tensors that
alias no input, and run only under inference mode (so they have no autograd formula).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["define_op"]

_library = torch.library.Library("triollm", "FRAGMENT")


def define_op(schema: str, implementation: Callable[..., Any],
              fake: Callable[..., Any]) -> Any:
    """Define ``triollm::<schema>`` with one implementation for every device and a fake
    (meta) one for tracing; returns the op (``torch.ops.triollm.<name>.default``)."""
    name = schema.split("(", 1)[0]
    _library.define(schema)
    _library.impl(name, implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(f"triollm::{name}", fake, lib=_library)
    return getattr(torch.ops.triollm, name).default
