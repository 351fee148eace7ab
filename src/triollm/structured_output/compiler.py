"""``GrammarCompiler``: one engine's constraints compiled once, cached, counted.

It chooses the backend (``StructuredOutputsConfig.backend``: ``auto`` tries llguidance,
then xgrammar where it is installed, and closes JSON objects to the properties their
schema lists unless it says otherwise, as vLLM's auto does; ``disable_fallback`` refuses
instead of trying the other), builds each backend's tokenizer data once (on the
first constraint it compiles), and keeps the compiled grammars in an LRU keyed by the
constraint's ``cache_key()`` and the backend. Thread-safe: the async engine compiles in
worker threads. An invalid constraint raises ``ValueError`` naming its field.
"""

from __future__ import annotations

import importlib.util
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from triollm.config import StructuredOutputsConfig
from triollm.structured_output.backend import GrammarBackend, GrammarOptions
from triollm.structured_output.grammar import CompiledGrammar
from triollm.structured_output.params import StructuredOutputsParams

__all__ = ["BACKENDS", "GrammarCacheStatistics", "GrammarCompiler"]

#: The backends, by their ``--structured-outputs-config`` names.
BACKENDS = ("auto", "xgrammar", "guidance")

#: How many compiled grammars an engine keeps (least recently used go first).
DEFAULT_CACHE_SIZE = 256
#: The most characters of a backend's complaint an error carries (some quote the
#: whole regex or grammar they refused, which a client may have sent by the megabyte).
MAX_ERROR_CHARS = 1000


@dataclass(frozen=True)
class GrammarCacheStatistics:
    """Since the engine started: compilations served from the cache, and compiled."""

    hits: int
    misses: int
    #: Grammars in the cache now.
    size: int


def _load(name: str) -> Callable[[Any, int, Iterable[int]], GrammarBackend]:
    if name == "xgrammar":
        from triollm.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend
    from triollm.structured_output.llguidance_backend import GuidanceBackend

    return GuidanceBackend


class GrammarCompiler:
    """Compiles requests' constraints for one engine's tokenizer, whose logits are
    ``vocab_size`` wide; ``eos_token_ids`` are what a complete grammar allows."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Iterable[int], *, cache_size: int = DEFAULT_CACHE_SIZE
                 ) -> None:
        if config.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config.backend: must be one of "
                             f"{', '.join(BACKENDS)}, got {config.backend!r}")
        if config.backend == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
            raise ValueError("structured_outputs_config.backend: xgrammar is not "
                             "installed (pip install 'triollm[xgrammar]')")
        self.config = config
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(sorted(eos_token_ids))
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    @property
    def candidates(self) -> tuple[str, ...]:
        """The backends tried, in order."""
        if self.config.backend == "auto":
            # llguidance first, unlike vLLM's auto: xgrammar 0.2.8 lets raw control
            # characters into JSON strings with length bounds (invalid JSON), llguidance
            # never does; xgrammar then takes what llguidance cannot compile.
            if importlib.util.find_spec("xgrammar") is not None:
                return ("guidance", "xgrammar")
            return ("guidance",)
        return (self.config.backend,)

    def compile(self, params: StructuredOutputsParams) -> tuple[CompiledGrammar, bool]:
        """The compiled grammar for ``params``, and whether it came from the cache.
        ``ValueError`` naming the field when it is invalid (or no backend takes it)."""
        field = f"structured_outputs.{params.kind}"
        key = params.cache_key()
        options = GrammarOptions(
            disable_any_whitespace=(params.disable_any_whitespace
                                    or self.config.disable_any_whitespace),
            # auto closes objects whichever backend compiles, as vLLM's auto (xgrammar,
            # strict) does; guidance chosen by name keeps JSON Schema's open default
            disable_additional_properties=(params.disable_additional_properties
                                           or self.config.disable_additional_properties
                                           or self.config.backend == "auto"),
            whitespace_pattern=params.whitespace_pattern)
        no_fallback = params.disable_fallback or self.config.disable_fallback
        candidates = self.candidates
        with self._lock:
            for name in candidates:
                cached = self._cache.get((name, key))
                if cached is not None:
                    self._cache.move_to_end((name, key))
                    self._hits += 1
                    return cached, True
            self._misses += 1
        errors = []
        for name in candidates:
            try:
                grammar = self._backend(name).compile(params, options)
            except ValueError as error:  # UnsupportedConstraint included
                # auto: what one backend cannot compile the other may take
                message = str(error)
                if len(message) > MAX_ERROR_CHARS:
                    message = message[:MAX_ERROR_CHARS] + "..."
                errors.append(f"{name}: {message}")
            else:
                with self._lock:
                    self._cache[(name, key)] = grammar
                    while len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
                return grammar, False
            if no_fallback:
                break
        raise ValueError(f"{field}: " + "; ".join(errors))

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = _load(name)(self._tokenizer, self._vocab_size,
                                      self._eos_token_ids)
                self._backends[name] = backend
            return backend

    def statistics(self) -> GrammarCacheStatistics:
        with self._lock:
            return GrammarCacheStatistics(self._hits, self._misses, len(self._cache))
