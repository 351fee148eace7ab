"""The ``--quantization`` methods triollm honours, by name (imports nothing heavy, so
that validating engine arguments does not load torch).

``int8`` and ``int4`` are triollm's own names for weight-only quantization of a
full-precision checkpoint at load (vLLM has no method of these names): ``int8`` one
symmetric scale per output channel, ``int4`` a scale and a zero point per group of
``--quantization-group-size`` input columns.

The checkpoint methods (``CHECKPOINT_METHODS``) read a checkpoint already quantized
(model/quantization/detect.py); ``--quantization`` may name the checkpoint's own method,
under vLLM's names for it, and nothing else.
"""

from __future__ import annotations

__all__ = ["CHECKPOINT_METHODS", "DEFAULT_GROUP_SIZE", "ON_THE_FLY_BITS", "check_group_size",
           "check_method"]

#: bits of each on-the-fly method.
ON_THE_FLY_BITS: dict[str, int] = {"int8": 8, "int4": 4}

#: Each checkpoint method triollm reads, with the ``--quantization`` names that ask for
#: it (vLLM's kernel-specific names included: they name the same checkpoints).
CHECKPOINT_METHODS: dict[str, tuple[str, ...]] = {
    "gptq": ("gptq", "gptq_marlin", "auto_gptq", "marlin"),
    "awq": ("awq", "awq_marlin", "auto_awq", "marlin"),
    "compressed-tensors": ("compressed-tensors",),
}

#: int4's input columns per group unless ``--quantization-group-size`` says otherwise.
DEFAULT_GROUP_SIZE = 128


def check_method(method: str) -> str | None:
    """Why ``method`` cannot be served (a sentence naming it), or None where it can."""
    if method in ON_THE_FLY_BITS or any(method in names for names in CHECKPOINT_METHODS.values()):
        return None
    honoured = ", ".join(ON_THE_FLY_BITS)
    return (f"the quantization method {method!r} is not supported (triollm quantizes a "
            f"full-precision checkpoint at load with: {honoured}; and reads "
            f"{', '.join(CHECKPOINT_METHODS)} checkpoints)")


def check_group_size(group_size: int) -> str | None:
    """Why ``group_size`` is no group size (a sentence), or None: -1 (one group per
    output channel) or a positive multiple of 32."""
    if group_size == -1 or (group_size > 0 and group_size % 32 == 0):
        return None
    return f"must be -1 (per channel) or a positive multiple of 32, got {group_size}"
