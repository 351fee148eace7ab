"""Constrained decoding: what a request asks for (``StructuredOutputsParams``), how the
engine compiles it into a grammar once (a backend: xgrammar or llguidance), and the
per-request matchers whose allowed-token masks the sampler applies."""

from triollm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
