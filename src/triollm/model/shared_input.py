"""Linear layers that read one input (a Llama layer's q, k and v projections; its gate
and up ones), found by watching a forward: packed bf16 layers (cpu/packed_linear.py)
and quantized ones (quantization/grouping.py) are grouped into one call each where the
model is compiled, and LoRA adapters (lora/layers.py) into one shrink."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, TypeVar

import torch
from torch import nn

__all__ = ["fuse_grouped_calls", "recording_calls", "runs_on_one_input"]

Recorded = TypeVar("Recorded", bound=nn.Module)


@contextlib.contextmanager
def recording_calls(model: nn.Module, kind: type[Recorded]
                    ) -> Iterator[list[tuple[torch.Tensor, Recorded]]]:
    """Within the block, every call of one of ``model``'s layers of type ``kind`` (on a
    positional input) is appended to the list it yields, with its input, in call order.
    It records through forward pre-hooks, removed on leaving: nothing on the calls'
    path once it is done."""
    calls: list[tuple[torch.Tensor, Recorded]] = []

    def record(layer: nn.Module, args: tuple[object, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and isinstance(layer, kind):
            calls.append((args[0], layer))

    hooks = [module.register_forward_pre_hook(record) for module in model.modules()
             if isinstance(module, kind)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


class _TakesInput(Protocol):
    in_features: int


Layer = TypeVar("Layer", bound=_TakesInput)


def runs_on_one_input(calls: list[tuple[torch.Tensor, Layer]],
                      joins: Callable[[Layer], bool] = lambda layer: True
                      ) -> list[list[Layer]]:
    """The runs of two or more layers ``calls`` shows called one after another on the
    same input tensor, with the same input size, each layer once a run. A layer
    ``joins`` rejects ends the run it interrupts and is in none."""
    runs: list[list[Layer]] = []
    run: list[Layer] = []
    previous: torch.Tensor | None = None
    for x, layer in calls:
        joinable = joins(layer)
        if (run and x is previous and joinable and layer not in run
                and layer.in_features == run[0].in_features):
            run.append(layer)
            continue
        if len(run) > 1:
            runs.append(run)
        run = [layer] if joinable else []
        previous = x
    if len(run) > 1:
        runs.append(run)
    return runs


def fuse_grouped_calls(graph: torch.fx.Graph, op: Callable[..., torch.Tensor],
                       groups: Mapping[tuple[int, ...], tuple[int, tuple[int, ...]]]) -> int:
    """In a graph traced by ``torch.compile``, replace the calls ``op(x, handle,
    out_features)`` of each group in ``groups`` (member handles in call order -> the
    group's handle and each member's out_features), where exactly its members are
    called on one input, by one call over the group and a slice of its result for each
    member. Returns how many groups were fused."""
    calls_on: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is op and not node.kwargs:
            source = node.args[0]
            if isinstance(source, torch.fx.Node):
                calls_on.setdefault(source, []).append(node)
    fused = 0
    for source, nodes in calls_on.items():
        group = groups.get(tuple(int(node.args[1]) for node in nodes))  # type: ignore[arg-type]
        if group is None:
            continue
        handle, sizes = group
        with graph.inserting_before(nodes[0]):
            whole = graph.call_function(op, (source, handle, sum(sizes)))
            start = 0
            for node, size in zip(nodes, sizes, strict=True):
                part = graph.call_function(torch.narrow, (whole, -1, start, size))
                node.replace_all_uses_with(part)
                start += size
        for node in nodes:
            graph.erase_node(node)
        fused += 1
    return fused
