"""``deepseek_r1``: DeepSeek-R1 and its distills (Qwen, Llama), QwQ."""

from __future__ import annotations

from triollm.reasoning.abstract import ReasoningParserManager
from triollm.reasoning.think_tags import ThinkTagReasoningParser

__all__ = ["DeepSeekR1ReasoningParser"]


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """R1's newer chat templates end the prompt with ``<think>\\n``, so the output may
    hold only ``</think>``: everything before it is reasoning, and an output that never
    closes it is reasoning cut short."""
