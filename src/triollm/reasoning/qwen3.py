"""``qwen3``: Qwen3 (and QwQ-style) models, whose output holds ``<think>...</think>``."""

from __future__ import annotations

from triollm.reasoning.abstract import ReasoningParserManager
from triollm.reasoning.think_tags import ThinkTagReasoningParser

__all__ = ["Qwen3ReasoningParser"]


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """With ``chat_template_kwargs={"enable_thinking": false}`` the template closes the
    reasoning in the prompt (``<think>\\n\\n</think>``): an output with no
    ``</think>`` is then all content (and ``is_reasoning_end`` of such a prompt is
    True). Otherwise an unclosed reasoning is reasoning cut short, as in vLLM."""

    @property
    def thinking_enabled(self) -> bool:
        return bool(self.chat_template_kwargs.get("enable_thinking", True))

    def unfinished(self, text: str) -> tuple[str | None, str | None]:
        if not self.thinking_enabled:
            return None, text
        return text, None
