"""Compiling on CPU, at start-up: the decode attention and the model's decoder.

The decode attention is the C kernel (model/cpu/decode.py) where it builds, else
``paged_decode_attention`` through ``torch.compile``; either is checked by a forward of
dummy decodes, and a failure leaves the gather path. With ``compile_model``, the
decoder (the model less its head) goes through ``torch.compile`` and is compiled at
once for every shape and thread count it will meet (saved, and loaded by a later start:
precompiled.py), then checked against the eager forward; a failure leaves the model
eager.

Each model is compiled into a code object of its own. dynamo keeps compiled code, and
counts recompiles against ``recompile_limit``, per code object; ``Module.compile``
would compile the decoder's ``forward``, whose code (transformers' decorators around
it) every model in the process shares. The compiled graphs' guards name the model's
own modules, so every later model added entries to one shared cache until the limit
made dynamo run the forward eagerly, where the paged attention has no metadata.
"""

from __future__ import annotations

import json
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from triollm.config import EngineConfig
from triollm.model.attention.kernel import DecodeKernel, DecodeStepKernel
from triollm.model.attention.metadata import KVCacheSpec, PagedAttentionMetadata, PagedKVCache
from triollm.model.attention.op import call_attention_from_cpp, in_compiled_forward
from triollm.model.attention.torch_decode import compiled_paged_decode_attention
from triollm.model.cpu.decode import CpuDecodeKernel
from triollm.model.cpu.kernel_ops import load_kernel_ops
from triollm.model.cpu.packed_linear import (
    PackedLinear,
    fuse_shared_input_calls,
    group_weights_of_shared_inputs,
    packed_weights,
    packed_weights_of,
)
from triollm.model.cpu.threads import ComputeThreads
from triollm.model.quantization.grouping import fuse_quantized_calls, group_quantized_layers
from triollm.model.quantization.kernel_calls import call_kernels_from_cpp
from triollm.model.quantization.linear import QuantizedLinear
from triollm.model.runners.batch import DecodeAttention, decode_groups, run_forward
from triollm.model.runners.precompiled import PrecompiledDecoder, artifact_key, cache_directory
from triollm.model.shared_input import recording_calls

__all__ = ["SCRATCH_BLOCKS", "CompilePlan", "CompileStopped", "DummyDecodes", "attention_in_cpp",
           "build_compiled", "choose_decode_attention", "compile_key", "compile_model",
           "plan_compile", "saves_artifacts"]

logger = logging.getLogger(__name__)

#: With the compiled kernel, which reads blocks in place, a call costs about as much as
#: a few hundred keys of padding, so a decode also joins a group when padding it adds
#: at most this many keys (``benchmarks/decode_attention.py --mixed``).
_KERNEL_PADDING_KEYS = 512
#: The C kernel reads each row's own blocks only: one call for every decode.
_UNLIMITED_PADDING_KEYS = 1 << 40
#: Blocks of a background compile's scratch KV cache: its dummy decodes use block 0 only.
SCRATCH_BLOCKS = 2


class DummyDecodes:
    """Forwards of dummy decodes over tables of copies of block 0, whose slots get
    overwritten before any request reads them: what compiles and checks a kernel."""

    def __init__(self, model: PreTrainedModel, kv_cache: PagedKVCache, config: EngineConfig,
                 specs: dict[int, KVCacheSpec]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = config.model.device
        self.rows, self.columns = self._sizes(config, specs)

    def _sizes(self, config: EngineConfig, specs: dict[int, KVCacheSpec]) -> tuple[int, int]:
        """A batch size and a block-table width for a forward that compiles: torch.compile
        ties sizes that are equal when it compiles ("duck sizing") and compiles again once
        they differ, so neither may equal any of the cache's or the model's dimensions."""
        hf_config = config.model.hf_config
        taken = {self.kv_cache.num_blocks, self.kv_cache.block_size, *(
            size for spec in specs.values() for size in (spec.num_kv_heads, spec.head_dim))}
        taken |= {int(getattr(hf_config, name, 0) or 0) for name in (
            "num_attention_heads", "hidden_size", "intermediate_size", "num_hidden_layers")}
        rows, columns = [n for n in (5, 7, 11, 13, 17, 19, 23, 29, 31) if n not in taken][:2]
        return rows, columns

    def run(self, attention: DecodeAttention, compiled: bool, rows: int | None = None
            ) -> torch.Tensor:
        """The logits of ``rows`` (default ``self.rows``) dummy decodes."""
        rows = self.rows if rows is None else rows
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.arange(rows, dtype=torch.long, device=self.device),
            decode_groups=decode_groups([[0] * self.columns] * rows,
                                        list(range(rows, 0, -1)), attention,
                                        self.kv_cache.block_size, self.device),
            decode_kernel=attention.kernel,
            decode_step=attention.step,
        )
        return run_forward(self.model, torch.arange(rows, dtype=torch.long, device=self.device),
                           torch.arange(rows - 1, -1, -1, device=self.device), 1, metadata,
                           compiled)


@torch.inference_mode()
def choose_decode_attention(dummy: DummyDecodes, c_kernel: DecodeKernel | None,
                            cache_dtype: torch.dtype) -> DecodeAttention:
    """The C kernel ``c_kernel`` where it runs, else the compiled torch one, each
    compiled (the torch one for every layer's shape) and checked by a forward of dummy
    decodes; a failure (no C compiler, say) leaves the gather path."""
    if c_kernel is not None:
        step = c_kernel.decode_step if isinstance(c_kernel, DecodeStepKernel) else None
        chosen = DecodeAttention(c_kernel, step, _UNLIMITED_PADDING_KEYS)
        if _runs(dummy, chosen):
            return chosen
    if cache_dtype in (torch.bfloat16, torch.float16):
        # checked against torch when it loaded, so this is a bug, not a toolchain (an
        # 8-bit cache is chosen whatever reads it: torch's path reads it too)
        raise RuntimeError(f"the CPU decode kernel failed its first run; the "
                           f"{cache_dtype} cache has no other decode path")
    chosen = DecodeAttention(compiled_paged_decode_attention, None, _KERNEL_PADDING_KEYS)
    if _runs(dummy, chosen):
        return chosen
    return DecodeAttention()


def _runs(dummy: DummyDecodes, attention: DecodeAttention) -> bool:
    try:
        dummy.run(attention, compiled=False)
    except Exception as error:  # compilation needs a working C++ toolchain
        kernel = attention.kernel
        logger.warning("the decode attention %s failed (%s: %s)",
                       getattr(kernel, "__name__", type(kernel).__name__),
                       type(error).__name__, error)
        return False
    return True


class CompileStopped(Exception):
    """The runner closed while its model compiled: the compile gave up between steps."""


def attention_in_cpp(attention: DecodeAttention) -> bool:
    """Whether a compiled model with ``attention`` calls the C++ op
    ``triollm::decode_attention`` (attention/op.py): where its decode steps run on the C
    kernel's one-call step and the C++ ops load."""
    return (isinstance(attention.kernel, CpuDecodeKernel) and attention.step is not None
            and load_kernel_ops())


def _inductor_with_shared_input_calls_fused(stop: Callable[[], bool],
                                            cpp_attention: bool) -> Any:
    """torch.compile's inductor backend, after fusing the calls of linear layers grouped
    on one input (packed_linear.py, grouping.py) and turning quantized layers' calls
    into the C++ op's (kernel_calls.py), and with ``cpp_attention`` the attention's
    (attention/op.py); it gives up (``CompileStopped``) before inductor starts once
    ``stop()`` is true."""
    from torch._inductor.compile_fx import compile_fx

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
                ) -> Any:
        if stop():
            raise CompileStopped
        graph = graph_module.graph
        changed = fuse_shared_input_calls(graph)
        changed += fuse_quantized_calls(graph)
        changed += call_attention_from_cpp(graph) if cpp_attention else 0
        if call_kernels_from_cpp(graph) + changed:
            graph_module.recompile()
        return compile_fx(graph_module, example_inputs)
    return backend


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module._call_impl(*args, **kwargs)


def _compile_on_own_code(module: nn.Module, **options: Any) -> None:
    """Make ``module``'s calls within a compiled forward (``forward_metadata`` set on the
    calling thread) run through ``torch.compile``, from a function whose code object is
    this module's alone, so that dynamo's cache for it holds this module's compiled code
    only. Calls on other threads (the model thread serving eagerly while another thread
    compiles) run the module eagerly."""
    function = types.FunctionType(_call.__code__.replace(), _call.__globals__, _call.__name__)
    compiled = torch.compile(types.MethodType(function, module), **options)

    weights = packed_weights_of(module)

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if in_compiled_forward():
            with packed_weights(weights):
                return compiled(*args, **kwargs)
        return module._call_impl(*args, **kwargs)
    module._compiled_call_impl = dispatch


@dataclass
class CompilePlan:
    """What compiling a model needs, found before it serves: the thread counts to compile
    for, and the eager forward's logits of the dummy decodes to check against."""

    counts: list[int]
    expected: torch.Tensor
    #: Groups of linear layers on one input, whose calls a compiled forward fuses.
    grouped: int


@torch.inference_mode()
def plan_compile(dummy: DummyDecodes, attention: DecodeAttention,
                 counts: list[int]) -> CompilePlan:
    """Run the dummy decodes eagerly, recording which linear layers share an input, and
    group those layers' weights (one tensor each group: the model must not be serving);
    ``counts``: the thread counts to compile for (``ComputeThreads.ladder``)."""
    with (recording_calls(dummy.model, PackedLinear) as calls,
          recording_calls(dummy.model, QuantizedLinear) as quantized_calls):
        expected = dummy.run(attention, compiled=False)
    grouped = (group_weights_of_shared_inputs(calls)
               + group_quantized_layers(quantized_calls))
    return CompilePlan(list(counts), expected, grouped)


@torch.inference_mode()
def build_compiled(dummy: DummyDecodes, attention: DecodeAttention, plan: CompilePlan,
                   dtype: torch.dtype, stop: Callable[[], bool] = lambda: False,
                   load_only: bool = False) -> bool:
    """Put the decoder (the model less its head) through ``torch.compile``, dynamic in
    the step's token count, and compile it now for every shape and thread count it
    will meet: one token, several tokens (any number: the attention and the packed
    linears are opaque custom ops), and each count in ``plan.counts``, since the
    compiled code is specialised to the thread count. The compiled forward must give
    the eager one's logits; if compiling fails or it does not, the model stays eager
    (returns False, with a warning). ``stop()``, checked between compiles, gives up
    quietly. ``load_only``: load every function from the cache (a compile process
    saved them), compiling none: a missing or broken one leaves the model eager. Sets
    this thread's torch thread count."""
    decoder = dummy.model.get_decoder()
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, 2 * len(plan.counts) + 2)
    started = time.perf_counter()
    shapes = [(count, batch) for count in plan.counts for batch in (1, dummy.rows)]
    backend = _inductor_with_shared_input_calls_fused(stop, attention_in_cpp(attention))
    # the saved (AOT) compile first (quantized layers: AOT, unsaved); where it fails,
    # dynamo's, which traces every start and checks its guards at every call
    precompiled: PrecompiledDecoder | None = None
    attempts = (["load"] if load_only else ["saved", "saved again", "dynamo"]
                if saves_artifacts(dummy.model) else ["unsaved", "dynamo"])
    while attempts:
        attempt = attempts.pop(0)
        try:
            if attempt == "dynamo":
                precompiled = None
                _compile_on_own_code(decoder, dynamic=True, backend=backend)
            else:
                directory = (None if attempt == "unsaved"
                             else cache_directory(compile_key(dummy, attention, dtype)))
                precompiled = PrecompiledDecoder(decoder, directory, backend,
                                                 load_only=attempt == "load")
                decoder._compiled_call_impl = precompiled
            _compile_shapes(dummy, attention, shapes, plan.expected, dtype, stop,
                            "loading" if attempt == "load" else "compiling")
            break
        except Exception as error:  # a missing or broken C++ toolchain, or a torch bug
            decoder._compiled_call_impl = None
            if isinstance(error, CompileStopped) or stop():  # dynamo may wrap it
                logger.info("compiling the model stopped: the engine is shutting down")
                return False
            if attempt == "load":
                logger.warning("loading the compiled model failed (%s: %s)",
                               type(error).__name__, error)
                if precompiled is not None:
                    precompiled.discard()
                return False
            if attempt == "saved" and precompiled is not None and precompiled.loaded:
                logger.warning("the compiled model loaded from the cache failed (%s: %s); "
                               "compiling it again", type(error).__name__, error)
                precompiled.discard()
                continue
            if attempt != "dynamo":
                logger.warning("the AOT compile of the model failed (%s: %s); compiling "
                               "it with dynamo, for this process only",
                               type(error).__name__, error)
                if precompiled is not None:
                    precompiled.discard()
                attempts = ["dynamo"]
                continue
            logger.warning("compiling the model failed (%s: %s); it runs eagerly",
                           type(error).__name__, error)
            return False
    if precompiled is not None and precompiled.loaded:
        logger.info("loaded the compiled model from %s in %.1f s (%d of %d shapes "
                    "compiled)", precompiled.directory, time.perf_counter() - started,
                    precompiled.compiled, len(shapes))
    else:
        logger.info("compiled the model in %.1f s (thread counts %s; %d groups of linear "
                    "layers on one input)", time.perf_counter() - started, plan.counts,
                    plan.grouped)
    return True


def saves_artifacts(model: nn.Module) -> bool:
    """Whether ``model``'s compiled decoder is saved as AOT artifacts (precompiled.py):
    not with quantized layers, whose handles are the process's, not the model's (a
    saved graph would name another process's layers): compiled the same way, for this
    process only."""
    return not any(isinstance(module, QuantizedLinear) for module in model.modules())


def compile_key(dummy: DummyDecodes, attention: DecodeAttention, dtype: torch.dtype) -> str:
    """The cache key of the compiled decoder of ``dummy``'s model with ``attention``
    (precompiled.artifact_key), with its groups of linear layers (``plan_compile``)."""
    kernel = attention.kernel
    weights = packed_weights_of(dummy.model)
    groups = sorted(weights.groups.items()) if weights is not None else []
    return artifact_key(dummy.model, dtype,
                        getattr(kernel, "__qualname__", type(kernel).__qualname__),
                        str(attention.step is not None), str(attention.padding_keys),
                        str(dummy.kv_cache.keys[0].dtype), json.dumps(groups),
                        # whether the graph calls the C++ attention op (which loads it)
                        str(attention_in_cpp(attention)))


def _compile_shapes(dummy: DummyDecodes, attention: DecodeAttention,
                    shapes: list[tuple[int, int]], expected: torch.Tensor,
                    dtype: torch.dtype, stop: Callable[[], bool], doing: str) -> None:
    """Run the compiled forward for each (thread count, batch) of ``shapes``, compiling
    (or loading) it; ``RuntimeError`` where the last one's logits differ from
    ``expected``. ``doing`` names it in the progress lines."""
    for index, (count, batch) in enumerate(shapes, 1):
        if stop():
            raise CompileStopped
        logger.info("%s the model: %d/%d (%d thread%s, %d token%s)...", doing, index,
                    len(shapes), count, "" if count == 1 else "s", batch,
                    "" if batch == 1 else "s")
        torch.set_num_threads(count)
        got = dummy.run(attention, compiled=True, rows=batch)
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    scale = float(expected.abs().max()) + 1.0
    if not torch.allclose(got.float(), expected.float(), rtol=0.0, atol=tolerance * scale):
        raise RuntimeError("the compiled forward's logits differ from the eager one's "
                           f"by {float((got - expected).abs().max()):.3g}")


def compile_model(dummy: DummyDecodes, attention: DecodeAttention, threads: ComputeThreads,
                  dtype: torch.dtype) -> bool:
    """Compile the model now, before it serves (``plan_compile``, then
    ``build_compiled``), and keep the thread policy to the counts compiled for."""
    try:
        plan = plan_compile(dummy, attention, threads.ladder())
    except Exception as error:
        logger.warning("compiling the model failed (%s: %s); it runs eagerly",
                       type(error).__name__, error)
        return False
    try:
        compiled = build_compiled(dummy, attention, plan, dtype)
    finally:
        torch.set_num_threads(threads.threads)
    if compiled:
        threads.keep_to(plan.counts)
    return compiled
