"""The reasoning parsers (deepseek_r1, qwen3) on recorded model texts, whole and streamed
token by token, and their token-id checks (is_reasoning_end, extract_content_ids)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.reasoning import ReasoningParser, ReasoningParserManager

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


@pytest.fixture(scope="module")
def think_tokenizer(tokenizer: Any) -> Any:
    """The test tokenizer with the think tags as single tokens, as in Qwen3 and R1."""
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(TAGS)
    return tok


def parser(name: str, tok: Any, **kwargs: Any) -> ReasoningParser:
    return ReasoningParserManager.get_reasoning_parser(name)(tok, **kwargs)


def stream(p: ReasoningParser, tok: Any, text: str, cuts: list[int] | None = None
           ) -> tuple[str, str]:
    """Stream ``text`` token by token (or in groups of tokens ending at ``cuts``), as
    the serving layer would: previous, current and delta text and ids."""
    ids = tok.encode(text, add_special_tokens=False)
    ends = sorted({min(c, len(ids)) for c in cuts} | {len(ids)}) if cuts else \
        list(range(1, len(ids) + 1))
    reasoning, content, prev_ids, prev_text = "", "", [], ""
    for end in ends:
        cur_ids = ids[:end]
        cur_text = tok.decode(cur_ids)
        if cur_text.endswith("\ufffd") and end < len(ids):
            continue  # as the detokenizer, wait for the rest of a character
        delta = p.extract_reasoning_streaming(prev_text, cur_text, cur_text[len(prev_text):],
                                              prev_ids, cur_ids, cur_ids[len(prev_ids):])
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
        prev_ids, prev_text = cur_ids, cur_text
    return reasoning, content


RECORDED = [
    # Qwen3 with thinking: both tags in the output.
    ("qwen3", "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
     "\nThe user wants 2+2. That is 4.\n", "\n\nThe answer is **4**."),
    # R1's template puts <think>\n in the prompt: only the end tag is generated.
    ("deepseek_r1", "Okay, so the user asks for the capital of France. Paris.\n</think>\n\n"
     "The capital of France is Paris.",
     "Okay, so the user asks for the capital of France. Paris.\n",
     "\n\nThe capital of France is Paris."),
    ("deepseek_r1", "<think>Let me think… 日本語 too.</think>Answer: 42",
     "Let me think… 日本語 too.", "Answer: 42"),
    # Cut by max_tokens inside the reasoning.
    ("deepseek_r1", "<think>First, consider the", "First, consider the", None),
    ("qwen3", "<think>First, consider the", "First, consider the", None),
    # Stopped right after the reasoning.
    ("qwen3", "<think>done</think>", "done", None),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), RECORDED)
def test_recorded_outputs_split_whole_and_streamed(think_tokenizer: Any, name: str, text: str,
                                                    reasoning: str, content: str | None) -> None:
    assert parser(name, think_tokenizer).extract_reasoning(text, None) == (reasoning, content)
    streamed = stream(parser(name, think_tokenizer), think_tokenizer, text)
    assert streamed == (reasoning or "", content or "")


def test_qwen3_without_thinking_is_all_content(think_tokenizer: Any) -> None:
    off = parser("qwen3", think_tokenizer, chat_template_kwargs={"enable_thinking": False})
    text = "Hello! How can I help you today?"
    assert off.extract_reasoning(text, None) == (None, text)
    assert stream(off, think_tokenizer, text) == ("", text)
    on = parser("qwen3", think_tokenizer)
    assert on.extract_reasoning(text, None) == (text, None)
    # The template closes the reasoning in the prompt; the engine reads that from ids.
    prompt = think_tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.is_reasoning_end(prompt)


def test_the_last_tag_of_a_multi_turn_prompt_decides(think_tokenizer: Any) -> None:
    p = parser("deepseek_r1", think_tokenizer)
    earlier = "User: hi\nAssistant: <think>greet</think>Hello!\nUser: 2+2?\nAssistant: "
    assert p.is_reasoning_end(think_tokenizer.encode(earlier))
    assert not p.is_reasoning_end(think_tokenizer.encode(earlier + "<think>\n"))
    assert not p.is_reasoning_end(think_tokenizer.encode(earlier + "<think>\nsum is"))
    assert p.is_reasoning_end(think_tokenizer.encode(earlier + "<think>\nsum</think>4"))
    assert not p.is_reasoning_end([])


def test_token_ids_mark_the_tags(think_tokenizer: Any) -> None:
    p = parser("qwen3", think_tokenizer)
    assert p.start_token_id == think_tokenizer.convert_tokens_to_ids("<think>")
    assert p.end_token_id == think_tokenizer.convert_tokens_to_ids("</think>")
    ids = think_tokenizer.encode("<think>why</think>because", add_special_tokens=False)
    assert think_tokenizer.decode(p.extract_content_ids(ids)) == "because"
    unfinished = think_tokenizer.encode("<think>still", add_special_tokens=False)
    assert p.extract_content_ids(unfinished) == []
    # A prompt and output together: the content follows this turn's </think>.
    both = think_tokenizer.encode("<think>a</think>b<think>c</think>d", add_special_tokens=False)
    assert think_tokenizer.decode(p.extract_content_ids(both)) == "d"


def test_a_tokenizer_without_the_tags_is_refused(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="think"):
        parser("deepseek_r1", tokenizer)


WORDS = st.sampled_from(["<think>", "</think>", "a", " b", "\n", "ü", "<", "think", ">", "答"])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["deepseek_r1", "qwen3"]), st.lists(WORDS, max_size=25),
       st.lists(st.integers(0, 40), max_size=10))
def test_any_text_streams_as_it_splits_whole(name: str, words: list[str], cuts: list[int]) -> None:
    tok = _TOKENIZER[0]
    text = "".join(words)
    whole = parser(name, tok).extract_reasoning(text, None)
    ids = tok.encode(text, add_special_tokens=False)
    if tok.decode(ids) != text:
        return
    # Two tags in a row, or a tag after text, need not stream as they split whole.
    if text.count("<think>") + text.count("</think>") > 1 or (
            "<think>" in text and not text.startswith("<think>")):
        stream(parser(name, tok), tok, text, cuts)
        return
    assert stream(parser(name, tok), tok, text, cuts) == (whole[0] or "", whole[1] or "")


_TOKENIZER: list[Any] = []


@pytest.fixture(autouse=True, scope="module")
def _share_tokenizer(think_tokenizer: Any) -> None:
    _TOKENIZER[:] = [think_tokenizer]
