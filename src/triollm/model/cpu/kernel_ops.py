"""``triollm::kernel_linear`` and ``triollm::decode_attention``: a compiled model's
quantized linear layers and its decode attention on the C kernels, called through torch
ops written in C++ (``csrc/kernel_ops.cpp``) rather than Python.

A torch op defined in Python (ops.py) costs the dispatcher, a Python function and a
ctypes call: about 16 us a call besides the kernel, against about 2 us for an op whose
kernel is C++. A decode token of a quantized Qwen2.5-0.5B makes 96 such calls in about
19 ms, so this is a tenth of it (docs/benchmarks.md).

The C++ is written against torch's stable ABI (``torch/csrc/stable``: C shims over
torch's tensors and dispatcher, no ATen headers), which builds in about two seconds
where a ``torch.utils.cpp_extension`` op takes minutes; it is built on first use with
the machine's C++ compiler (``$CXX``, else ``c++``) into the kernel cache (build.py),
keyed as the C kernels are and by torch's version, and loaded with
``torch.ops.load_library``. Where it does not build (no C++ compiler, torch without the
headers) a warning says so (strict mode: ``KernelBuildError``) and compiled models
keep the Python ops.

A layer is registered under its handle with its packed tensors, its bias and the
addresses of the C functions that multiply by them (its kernel library's, which ctypes
loaded): the op's registry holds those tensors until ``unregister_linear``. The op
runs the product on torch's OpenMP thread count, or on the helper pool where the
calling thread may use helpers (helpers.py sets that in the pool's library too), or on
AMX tiles from the layer's ``tiles_from`` rows (never with helpers), and adds the bias
in bf16 as ``out + bias`` would.

``decode_attention`` takes ``triollm::paged_attention``'s arguments. Where the calling
thread has begun a step of decodes only (``begin_decode_step``: every layer's KV caches,
the step's slots, block tables and context lengths, and the decode kernel's one-call step
as C functions, csrc/decode.c), it runs that step's call for the layer, cache writes
included; anywhere else (prefill chunks, mixed steps, layouts the kernel does not read)
it hands the call to ``paged_attention``, the Python op, through the dispatcher. The
begun step holds its tensors until ``end_decode_step``; a thread's next begun step
replaces it. Errors cross the C++ boundary as ``RuntimeError`` (the kernel's lack of
scratch memory, and any exception of the Python op it hands a call to).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import torch

from triollm.model.cpu.build import (
    CSRC,
    build_failed,
    cache_key,
    install,
    load_pool,
    run_compiler,
)

__all__ = ["NativeDecodeStep", "NativeProducts", "begin_decode_step", "decode_attention_op",
           "end_decode_step", "kernel_linear_op", "kernel_ops_loaded", "load_kernel_ops",
           "register_linear", "unregister_linear"]

logger = logging.getLogger(__name__)

_SOURCE = CSRC / "kernel_ops.cpp"
#: The first torch release whose stable ABI has every op kernel_ops.cpp calls
#: (``get_num_threads``, ``contiguous``, ``new_empty``).
_STABLE_OPS_FROM = (2, 10)
#: Whether ``_load`` has loaded the ops in this process.
_loaded = False
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-Wall", "-Wextra"]


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def _build() -> Path:
    include, lib = _torch_dirs()
    source = _SOURCE.read_text()
    key = cache_key(source, " ".join(_FLAGS), torch.__version__, str(lib),
                    compiler=_compiler())
    name = f"kernel_ops_{key}.so"

    def make(built: Path) -> None:
        # torch's headers as system ones: their own warnings are not ours
        run_compiler([_compiler(), *_FLAGS, "-isystem", str(include), str(_SOURCE),
                      "-o", str(built), f"-L{lib}", "-ltorch_cpu", "-lc10",
                      f"-Wl,-rpath,{lib}"])
    return install(name, make)


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _kernel_linear_fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _decode_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           layer: int, scale: float, sliding_window: int | None,
                           softcap: float | None) -> torch.Tensor:
    return torch.empty_like(query)


def kernel_ops_loaded() -> bool:
    """Whether the C++ ops are loaded in this process (this never builds them)."""
    return _loaded


@cache
def load_kernel_ops() -> bool:
    """Whether the C++ ops are loaded (built now unless cached); False, with a warning,
    where they cannot be (strict mode: raises ``KernelBuildError``)."""
    return _load()


def _load() -> bool:
    if _torch_release() < _STABLE_OPS_FROM:
        logger.info("torch %s predates the stable ABI's ops kernel_ops.cpp uses (2.10): "
                    "compiled models call the C kernels through Python ops", torch.__version__)
        return False
    try:
        torch.ops.load_library(str(_build()))
        pool = load_pool()
    except (OSError, subprocess.SubprocessError) as error:
        build_failed("C++ kernel ops", "the Python op of each compiled quantized layer and "
                     "attention", error)
        return False
    torch.library.register_fake("triollm::kernel_linear")(_kernel_linear_fake)
    torch.library.register_fake("triollm::decode_attention")(_decode_attention_fake)
    torch.ops.triollm.set_kernel_pool(_address(pool.triollm_pool_spare_threads))
    global _loaded
    _loaded = True
    return True


def _address(function: Any) -> int:
    address = ctypes.cast(function, ctypes.c_void_p).value
    if not address:
        raise ValueError(f"{function} has no address")
    return int(address)


class NativeProducts:
    """A kernel library's C functions for ``register_linear``: the product on OpenMP
    threads and on the helper pool, and optionally on AMX tiles from ``tiles_from``
    rows (ctypes functions; their addresses are what the op calls)."""

    def __init__(self, product: Any, pooled: Any, tiles: Any | None = None,
                 tiles_from: int | None = None) -> None:
        self.product = _address(product)
        self.pooled = _address(pooled)
        self.tiles = 0 if tiles is None or tiles_from is None else _address(tiles)
        self.tiles_from = tiles_from or 0


def register_linear(handle: int, weight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None, in_features: int, out_features: int,
                    group_size: int, products: NativeProducts) -> bool:
    """Let ``kernel_linear(x, handle, out_features)`` multiply by the weight packed in
    ``weight`` and ``scales`` with ``products`` (and add the bf16 ``bias``); False where
    the C++ ops are not loaded."""
    if not load_kernel_ops():
        return False
    torch.ops.triollm.register_kernel_linear(
        handle, weight, scales, bias, in_features, out_features, group_size,
        products.product, products.pooled, products.tiles, products.tiles_from)
    return True


def unregister_linear(handle: int) -> None:
    """Drop ``handle``'s layer (and the registry's references to its tensors)."""
    if load_kernel_ops.cache_info().currsize and load_kernel_ops():
        torch.ops.triollm.unregister_kernel_linear(handle)


def kernel_linear_op() -> object:
    """The op ``torch.ops.triollm.kernel_linear.default`` (the C++ ops must be loaded)."""
    return torch.ops.triollm.kernel_linear.default


class NativeDecodeStep:
    """The decode kernel's one-call step for ``begin_decode_step``: on OpenMP threads and
    on the helper pool (ctypes functions; their addresses are what the op calls)."""

    def __init__(self, plain: Any, pooled: Any) -> None:
        self.plain = _address(plain)
        self.pooled = _address(pooled)


def begin_decode_step(keys: list[torch.Tensor], values: list[torch.Tensor],
                      slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                      step: NativeDecodeStep) -> bool:
    """Until ``end_decode_step`` on this thread, run ``decode_attention``'s calls on
    ``step`` over the caches of every layer (``keys``, ``values``) for this step of
    decodes (``slots``, ``tables`` ``[rows, blocks]``, ``lengths``: contiguous int64);
    False, with nothing begun, where the C++ ops are not loaded or the kernel does not
    read these tensors."""
    if not load_kernel_ops():
        return False
    return bool(torch.ops.triollm.begin_decode_step(keys, values, slots, tables, lengths,
                                                    step.plain, step.pooled))


def end_decode_step() -> None:
    """End this thread's step (letting go of its tensors)."""
    torch.ops.triollm.end_decode_step()


def decode_attention_op() -> object:
    """The op ``torch.ops.triollm.decode_attention.default`` (the C++ ops must be
    loaded)."""
    return torch.ops.triollm.decode_attention.default
