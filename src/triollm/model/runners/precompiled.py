"""The compiled decoder kept on disk, so that a restart loads it instead of tracing it.

``torch.compile`` spends most of a warm start in dynamo, tracing the decoder's Python
once per shape and thread count, even when inductor's caches hold every compiled graph.
torch's AOT compile (``aot_compile``) traces once and gives a function that can be
saved whole (the bytecode dynamo wrote, the compiled graph, the signature) and loaded by
a later process. A ``PrecompiledDecoder`` is the decoder's compiled call made of such
functions, one per (thread count, one token or several): it loads each from the cache
where an earlier start saved it, else compiles and saves it.

The loaded functions run without dynamo's guards (as vLLM's AOT compile does: its
guards name objects of the process that compiled): the dispatcher picks the function by
the thread count and whether the step has one token, and everything else the compiled
code depends on is in the cache key (``artifact_key``): torch's and transformers'
versions, triollm's model code, the model's config and dtype, the decode attention, the
CPU, and the packed linear layers' handles (their indices in the model's
``PackedWeights``, which the graph holds as constants).

Artifacts are pickles, loaded as code, so they are trusted the way the C kernels are
(model/cpu/build.py): from a directory of this user's that nobody else may write, each a
regular file of this user's that nobody else may write; written whole (a private
temporary file renamed over the name). One that fails to load is discarded with a
warning and compiled again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from triollm.model.attention.op import in_compiled_forward
from triollm.model.cpu.build import cpu_signature, trusted_cache_dir
from triollm.model.cpu.packed_linear import PackedLinear, packed_weights, packed_weights_of
from triollm.model.cpu.private_cache import untrusted_library

__all__ = ["CACHE_NAME", "PrecompiledDecoder", "artifact_key", "cache_directory",
           "has_artifacts"]

logger = logging.getLogger(__name__)

#: The directory under triollm's cache root (``TRIOLLM_CACHE``) that holds artifacts.
CACHE_NAME = "compiled"
#: Changes whenever what is saved, or how it is keyed, changes.
_FORMAT = "1"
_MODEL_CODE = Path(__file__).resolve().parents[1]
#: A key's artifacts are deleted once no start has used them for this many days.
_UNUSED_DAYS = 30


def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(_MODEL_CODE.rglob("*.py")):
        digest.update(path.relative_to(_MODEL_CODE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def artifact_key(model: nn.Module, dtype: torch.dtype, *details: str) -> str:
    """The cache key of ``model``'s compiled decoder: what changes the compiled code,
    besides the thread count and the token count, which name the files under it.
    ``details`` adds what the caller decides (the decode attention, the cache's dtype)."""
    config = getattr(model, "config", None)
    handles = [module.handle for module in model.modules() if isinstance(module, PackedLinear)]
    parts = [
        _FORMAT, torch.__version__, transformers.__version__, sys.version, _source_hash(),
        type(model).__qualname__, config.to_json_string() if config is not None else "",
        str(dtype), cpu_signature(), json.dumps(handles), *details,
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module._call_impl(*args, **kwargs)


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs["inputs_embeds"]
        return int(ids.shape[-2])
    return int(ids.shape[-1])


class PrecompiledDecoder:
    """``decoder``'s compiled call: within a compiled forward (``forward_metadata`` set
    on the calling thread), the function for this thread count and token count, loaded
    from ``directory`` or compiled (then saved there) at its first call; elsewhere the
    eager module. ``directory`` None: compile without saving. ``load_only``: a function
    not in the cache is a ``FileNotFoundError``, not compiled."""

    def __init__(self, decoder: nn.Module, directory: Path | None,
                 backend: Callable[..., Any], *, load_only: bool = False) -> None:
        self.decoder = decoder
        self.directory = directory
        self.backend = backend
        self.load_only = load_only
        #: How many functions came from the cache, and how many were compiled.
        self.loaded = 0
        self.compiled = 0
        self._functions: dict[tuple[int, bool], Callable[..., Any]] = {}
        self._weights = packed_weights_of(decoder)
        # the saved bytecode runs in globals of its own; its code is this module's alone
        self._code = types.FunctionType(_call.__code__.replace(), _call.__globals__,
                                        _call.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not in_compiled_forward():
            return self.decoder._call_impl(*args, **kwargs)
        key = (torch.get_num_threads(), _tokens(args, kwargs) == 1)
        with packed_weights(self._weights):
            function = self._functions.get(key)
            if function is None:
                function = self._load(key) or self._compile(key, args, kwargs)
                self._functions[key] = function
            return function(self.decoder, *args, **kwargs)

    def _path(self, key: tuple[int, bool]) -> Path | None:
        return None if self.directory is None else _artifact(self.directory, *key)

    def _load(self, key: tuple[int, bool]) -> Callable[..., Any] | None:
        path = self._path(key)
        if path is None or not os.path.lexists(path):
            return None
        reason = untrusted_library(path)
        if reason is not None:
            logger.warning("the compiled model %s is not safe to load (%s); compiling it "
                           "again", path, reason)
            return None
        try:
            data = path.read_bytes()
            header, _, payload = data.partition(b"\n")
            modules = json.loads(header)["modules"]
            f_globals = {**_call.__globals__, **{
                name: importlib.import_module(module) for name, module in modules.items()}}
            from torch._dynamo.aot_compile import AOTCompiledFunction

            loaded = AOTCompiledFunction.deserialize(
                payload, f_globals, {"decoder": self.decoder})
        except Exception as error:  # corrupt, truncated, or from an incompatible torch
            logger.warning("the compiled model %s could not be loaded (%s: %s); compiling "
                           "it again", path, type(error).__name__, error)
            self.discard(key)
            return None
        self.loaded += 1
        return loaded.fn

    def _compile(self, key: tuple[int, bool], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Callable[..., Any]:
        if self.load_only:
            raise FileNotFoundError(f"no compiled model at {self._path(key)}")
        compiler = torch.compile(types.MethodType(self._code, self.decoder), fullgraph=True,
                                 dynamic=True, backend=self.backend,
                                 options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
        # dynamo's usual compile restarts its analysis to specialise a float it cannot
        # keep symbolic; the AOT compile has no restart, so floats are specialised
        with torch._dynamo.config.patch(specialize_float=True):
            function = compiler.aot_compile((args, kwargs))  # type: ignore[attr-defined]
        self.compiled += 1
        path = self._path(key)
        if path is not None:
            try:
                self._save(function, path)
            except Exception as error:  # unpicklable state: the compiled code still runs
                logger.warning("the compiled model could not be saved to %s (%s: %s)",
                               path, type(error).__name__, error)
        return function.fn

    def _save(self, function: Any, path: Path) -> None:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        payload = AOTCompiledFunction.serialize(function, {"decoder": self.decoder})
        # names of modules dynamo's bytecode reads from its globals under names it made up
        runtime = function._artifacts.runtime_env
        f_globals = self._code.__globals__
        modules = {name: f_globals[name].__name__ for name in runtime.external_refs
                   if isinstance(f_globals.get(name), types.ModuleType)}
        header = json.dumps({"modules": modules}).encode()
        assert self.directory is not None
        with tempfile.NamedTemporaryFile(dir=self.directory, delete=False,
                                         prefix=".writing-") as file:  # 0600
            file.write(header + b"\n" + payload.serialized_data)
        os.replace(file.name, path)

    def discard(self, key: tuple[int, bool] | None = None) -> None:
        """Forget the function for ``key`` (None: all of them) and delete its file."""
        for each in [key] if key is not None else list(self._functions):
            self._functions.pop(each, None)
            path = self._path(each)
            if path is not None:
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass


def _artifact(directory: Path, threads: int, one: bool) -> Path:
    return directory / f"{threads}-threads-{'one' if one else 'many'}-tokens.bin"


def has_artifacts(directory: Path, counts: list[int]) -> bool:
    """Whether ``directory`` holds a saved function for each thread count of ``counts``,
    for one token and for several."""
    return all(_artifact(directory, count, one).exists()
               for count in counts for one in (True, False))


def cache_directory(key: str) -> Path | None:
    """The private directory of the artifacts under ``key``; None where it cannot be
    made (the compiled model is then not saved)."""
    try:
        root = trusted_cache_dir(CACHE_NAME)
        directory = root / key
        directory.mkdir(mode=0o700, exist_ok=True)
        os.utime(directory)
        _prune(root, keep=directory)
    except Exception as error:
        logger.warning("the compiled model is not cached (%s: %s)", type(error).__name__,
                       error)
        return None
    return directory



def _prune(root: Path, keep: Path) -> None:
    """Delete the artifacts of keys no start has used for ``_UNUSED_DAYS`` (each key's
    directory is touched whenever a start uses it): a new torch, triollm or model
    config makes a new key and leaves the old one unused."""
    cutoff = time.time() - _UNUSED_DAYS * 86400
    for directory in root.iterdir():
        if directory != keep and directory.is_dir() and directory.stat().st_mtime < cutoff:
            shutil.rmtree(directory, ignore_errors=True)
