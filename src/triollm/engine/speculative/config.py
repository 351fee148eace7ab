"""``speculative_config`` (``--speculative-config``): vLLM's fields for the ``ngram``
method, checked once into a frozen ``SpeculativeConfig``. Every other method and field
is refused by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from triollm.config import SpeculativeConfig
from triollm.engine.resolve import fail, json_object

__all__ = ["ROWS_AT_ONE_ROW_COST", "default_disable_by_batch_size", "speculative_config"]

_NAME = "speculative_config"
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
           "disable_by_batch_size")
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
                   f"with the ngram method only (fields: {', '.join(_FIELDS)})")
    method = fields.get("method")
    if method is None:
        raise fail(f"{_NAME}.method", "is required: 'ngram' (prompt lookup)")
    if method != "ngram":
        raise fail(f"{_NAME}.method", f"{method!r} is not supported: only 'ngram' (prompt "
                   f"lookup); draft models, EAGLE and MTP are not")
    if "num_speculative_tokens" not in fields:
        raise fail(f"{_NAME}.num_speculative_tokens", "is required with method 'ngram'")
    k = _positive("num_speculative_tokens", fields["num_speculative_tokens"])
    low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = _DEFAULT_LOOKUP
    low = _positive("prompt_lookup_min", high if low is None else low)
    high = _positive("prompt_lookup_max", low if high is None else high)
    if low > high:
        raise fail(f"{_NAME}.prompt_lookup_min", f"{low} must be <= prompt_lookup_max={high}")
    batch = fields.get("disable_by_batch_size")
    batch = (default_disable_by_batch_size(k) if batch is None
             else _positive("disable_by_batch_size", batch))
    if async_scheduling:
        raise fail(_NAME, "speculative decoding does not run with async_scheduling: pass "
                   "async_scheduling=False (--no-async-scheduling)")
    if runner != "generate":
        raise fail(_NAME, "speculative decoding is for generation models, not pooling ones")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=low,
                             prompt_lookup_max=high, disable_by_batch_size=batch)
