"""Reasoning parsers: a model's thinking split from its answer."""

from triollm.reasoning.abstract import ReasoningParser, ReasoningParserManager

__all__ = ["ReasoningParser", "ReasoningParserManager"]
