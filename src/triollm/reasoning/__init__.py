"""Reasoning parsers: a model's thinking split from its answer. Importing the package
registers the built-in parsers (``deepseek_r1``, ``qwen3``)."""

from triollm.reasoning import deepseek_r1, qwen3  # noqa: F401 (they register themselves)
from triollm.reasoning.abstract import ReasoningParser, ReasoningParserManager

__all__ = ["ReasoningParser", "ReasoningParserManager"]
