"""``speculative_config`` (``--speculative-config``): vLLM's fields for the ``ngram``
and ``draft_model`` methods, checked once into a frozen ``SpeculativeConfig``. Every
other method and field is refused by name; a draft model's vocabulary is checked
against the target's when it loads (model/runners/draft_model.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from triollm.config import SpeculativeConfig
from triollm.engine.resolve import fail, json_object

__all__ = ["ROWS_AT_ONE_ROW_COST", "default_disable_by_batch_size", "speculative_config"]

_NAME = "speculative_config"
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
           "disable_by_batch_size", "model", "draft_tensor_parallel_size")
_METHODS = ("ngram", "draft_model")
#: The fields only one method takes.
_NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")
_DRAFT_ONLY = ("model", "draft_tensor_parallel_size")
#: vLLM's default n-gram size when neither bound is given.
_DEFAULT_LOOKUP = 5
#: Rows that the 0.5B model's bf16 linear layers take in little more than the time of
#: one on the reference machine's CPU (AVX512-BF16: 1-6 rows cost 0.93-1.16x one row,
#: 8 rows 1.58x, 16 rows 2.65x; docs/serving.md, "Speculative decoding"). A step
#: speculates while its running requests' rows, each 1 + num_speculative_tokens, stay
#: within this many.
ROWS_AT_ONE_ROW_COST = 8


def default_disable_by_batch_size(num_speculative_tokens: int) -> int:
    """The most running requests for which a step still speculates, by default."""
    return max(1, ROWS_AT_ONE_ROW_COST // (1 + num_speculative_tokens))


def _positive(field: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise fail(f"{_NAME}.{field}", f"must be an integer >= 1, got {value!r}")
    return value


def speculative_config(value: Mapping[str, Any] | str | None, *, async_scheduling: bool,
                       runner: str) -> SpeculativeConfig | None:
    """The checked config (None: no speculation); ``ValueError`` naming the field."""
    if value is None:
        return None
    fields = json_object(_NAME, value)
    if not fields:
        return None
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise fail(_NAME, f"unsupported field(s) {', '.join(unknown)}: triollm speculates "
                   f"with the ngram and draft_model methods only (fields: "
                   f"{', '.join(_FIELDS)})")
    method = fields.get("method")
    if method is None:
        raise fail(f"{_NAME}.method", "is required: 'ngram' (prompt lookup) or "
                   "'draft_model' (with model)")
    if method not in _METHODS:
        raise fail(f"{_NAME}.method", f"{method!r} is not supported: only 'ngram' (prompt "
                   f"lookup) and 'draft_model'; EAGLE, Medusa and MTP are not")
    other = _DRAFT_ONLY if method == "ngram" else _NGRAM_ONLY
    for field in other:
        if field in fields:
            raise fail(f"{_NAME}.{field}", f"does not apply to method {method!r}")
    if "num_speculative_tokens" not in fields:
        raise fail(f"{_NAME}.num_speculative_tokens", f"is required with method {method!r}")
    k = _positive("num_speculative_tokens", fields["num_speculative_tokens"])
    draft = None
    low = high = 0
    if method == "draft_model":
        draft = fields.get("model")
        if not isinstance(draft, str) or not draft:
            raise fail(f"{_NAME}.model", f"is required with method 'draft_model': the draft "
                       f"model's path or hub id, got {draft!r}")
        size = fields.get("draft_tensor_parallel_size", 1)
        if size != 1 or isinstance(size, bool):
            raise fail(f"{_NAME}.draft_tensor_parallel_size", f"must be 1: the draft runs "
                       f"on the target's one device, got {size!r}")
    else:
        low, high = _lookup_window(fields.get("prompt_lookup_min"),
                                   fields.get("prompt_lookup_max"))
    batch = fields.get("disable_by_batch_size")
    batch = (default_disable_by_batch_size(k) if batch is None
             else _positive("disable_by_batch_size", batch))
    if async_scheduling:
        raise fail(_NAME, "speculative decoding does not run with async_scheduling: pass "
                   "async_scheduling=False (--no-async-scheduling)")
    if runner != "generate":
        raise fail(_NAME, "speculative decoding is for generation models, not pooling ones")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=low,
                             prompt_lookup_max=high, disable_by_batch_size=batch,
                             model=draft)


def _lookup_window(low: object, high: object) -> tuple[int, int]:
    """``ngram``'s n-gram sizes, vLLM's default where neither bound is given."""
    if low is None and high is None:
        low = high = _DEFAULT_LOOKUP
    low = _positive("prompt_lookup_min", high if low is None else low)
    high = _positive("prompt_lookup_max", low if high is None else high)
    if low > high:
        raise fail(f"{_NAME}.prompt_lookup_min", f"{low} must be <= prompt_lookup_max={high}")
    return low, high
