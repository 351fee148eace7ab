"""Chat messages to prompt tokens, as vLLM renders them.

A message's ``content`` may be a string or OpenAI's list of content parts. Chat
templates come in two kinds: those that print ``message['content']`` as a string and
those that loop over its parts. ``content_format`` says which (vLLM's
``--chat-template-content-format``): ``"string"`` joins the text parts with newlines,
``"openai"`` hands the template a list of ``{"type": "text", "text": ...}`` parts, and
``"auto"`` (the default) reads the template to decide. This engine serves text-only
models, so any other part type (an image, audio, video) is refused by name.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    import jinja2.nodes
    from transformers import PreTrainedTokenizerBase

__all__ = ["CONTENT_FORMATS", "RESERVED_TEMPLATE_KWARGS", "ContentFormat",
           "chat_template_call", "detect_content_format", "normalize_messages",
           "render_chat", "render_chat_text", "resolve_template"]

ContentFormat = Literal["auto", "string", "openai"]
CONTENT_FORMATS: tuple[ContentFormat, ...] = ("auto", "string", "openai")

#: Part types that carry text. ``input_text``/``output_text`` are the Responses API's.
_TEXT_PARTS = ("text", "input_text", "output_text")

#: ``apply_chat_template`` arguments a request's ``chat_template_kwargs`` may not set:
#: each has a field of its own, or would change what the call returns.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "add_generation_prompt", "continue_final_message",
    "tokenizer_kwargs", "sanitize_control_tokens",
})


def _text_of_part(part: object, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise ValueError(f"{where}: a content part must be an object with a 'type'")
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.text: a {kind!r} part needs a string 'text'")
        return text
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return cast(str, part["refusal"])
    raise ValueError(f"{where}.type: content parts of type {kind!r} are not supported: "
                     f"this engine serves text-only models (send 'text' parts)")


def normalize_messages(messages: list[dict[str, Any]], content_format: ContentFormat
                       ) -> list[dict[str, Any]]:
    """Messages whose content is put in ``content_format``, as vLLM puts it:
    ``"string"``: text, the parts joined by newlines; ``"openai"``: a list of
    ``{"type": "text", "text": ...}`` parts, a string content becoming one part (a tool
    message's text parts are joined all the same, since templates print tool results
    as text). A missing content is ``""`` or ``[]``."""
    if content_format not in ("string", "openai"):
        raise ValueError(f"content_format: expected 'string' or 'openai', got "
                         f"{content_format!r}")
    normalized = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if content is None:
            texts: list[str] = []
        elif isinstance(content, str):
            texts = [content]
        elif isinstance(content, list):
            texts = [_text_of_part(part, f"messages[{index}].content[{number}]")
                     for number, part in enumerate(content)]
        else:
            raise ValueError(f"messages[{index}].content: expected a string or a list of "
                             f"content parts")
        message = dict(message)
        if content_format == "string" or message.get("role") == "tool":
            message["content"] = "\n".join(texts)
        else:
            message["content"] = [{"type": "text", "text": text} for text in texts]
        normalized.append(message)
    return normalized


def resolve_template(tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                     tools: list[dict[str, Any]] | None = None) -> str:
    """The template text that will render: the one given, else the tokenizer's."""
    if chat_template is not None:
        return chat_template
    return cast(str, tokenizer.get_chat_template(None, tools=tools))


# -- reading a template: does it loop over message content? ---------------------------


def _loads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` reads one of ``names`` (or its ``key`` item), possibly through
    filters, tests or a slice: ``messages``, ``messages[1:]``, ``m['content'] | trim``."""
    import jinja2.nodes as nodes

    if isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
        return _loads(node.node, names, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _loads(node.node, names, key)
    if key is not None:
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            return node.arg.value == key and _loads(node.node, names)
        if isinstance(node, nodes.Getattr):
            return node.attr == key and _loads(node.node, names)
        return False
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _aliases(root: jinja2.nodes.Template, name: str, key: str | None = None) -> set[str]:
    """``name`` (or its ``key`` item) and every variable assigned from it, transitively."""
    import jinja2.nodes as nodes

    found = {name} if key is None else set()
    sources = {name}
    changed = True
    while changed:
        changed = False
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if (isinstance(target, nodes.Name) and target.name not in found
                    and (_loads(assign.node, found) or _loads(assign.node, sources, key))):
                found.add(target.name)
                changed = True
    return found


def _loop_targets(root: jinja2.nodes.Template, names: set[str], key: str | None = None
                  ) -> Iterator[str]:
    import jinja2.nodes as nodes

    for loop in root.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and _loads(loop.iter, names, key):
            yield loop.target.name


#: Detected formats by the template's SHA-256: a request may send its own template, so
#: the cache keeps digests, not the (possibly large) texts.
_DETECTED: OrderedDict[str, ContentFormat] = OrderedDict()
_DETECTED_MAX = 64
_DETECTED_LOCK = threading.Lock()


def detect_content_format(chat_template: str) -> ContentFormat:
    """``"openai"`` when the template loops over a message's content (directly, or
    through a variable assigned from it), else ``"string"``; ``"string"`` too for a
    template that does not parse."""
    key = hashlib.sha256(chat_template.encode("utf-8", "surrogatepass")).hexdigest()
    with _DETECTED_LOCK:
        if key in _DETECTED:
            _DETECTED.move_to_end(key)
            return _DETECTED[key]
    found = _detect(chat_template)
    with _DETECTED_LOCK:
        _DETECTED[key] = found
        while len(_DETECTED) > _DETECTED_MAX:
            _DETECTED.popitem(last=False)
    return found


def _detect(chat_template: str) -> ContentFormat:
    import jinja2
    import jinja2.ext

    try:
        root = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "string"
    messages = _aliases(root, "messages")
    for message in set(_loop_targets(root, messages)):
        if next(_loop_targets(root, {message}, "content"), None) is not None:
            return "openai"
        contents = _aliases(root, message, "content")
        if contents and next(_loop_targets(root, contents), None) is not None:
            return "openai"
    return "string"


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], *,
                add_special_tokens: bool = False, **rendering: Any) -> list[int]:
    """Chat messages through the chat template, as token ids: ``render_chat_text``'s
    text encoded, ``add_special_tokens`` adding the tokenizer's own (a BOS token, for
    most) to what the template wrote, as vLLM's field of that name."""
    text = render_chat_text(tokenizer, messages, **rendering)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                     **rendering: Any) -> str:
    """Chat messages through the chat template (``chat_template`` or the tokenizer's),
    as text; ``rendering`` as ``chat_template_call`` takes it. Raises ``ValueError``
    naming the field at fault."""
    conversation, arguments = chat_template_call(tokenizer, messages, **rendering)
    # transformers types the result for every combination of its flags; with
    # tokenize=False it is the rendered text.
    return cast(str, tokenizer.apply_chat_template(conversation, **arguments))


def chat_template_call(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], *,
                       chat_template: str | None = None, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       tools: list[dict[str, Any]] | None = None,
                       documents: list[dict[str, Any]] | None = None,
                       chat_template_kwargs: Mapping[str, Any] | None = None,
                       content_format: ContentFormat = "auto"
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What ``render_chat_text`` passes to ``tokenizer.apply_chat_template``: the
    conversation and the keyword arguments (plain data, so a worker process holding a
    copy of the tokenizer can render it). ``continue_final_message`` leaves the last
    (assistant) message open for the model to continue; ``chat_template_kwargs`` are
    extra template variables (``enable_thinking``). Raises ``ValueError`` naming the
    field at fault."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be used with "
                         "add_generation_prompt; set add_generation_prompt to false")
    extra = dict(chat_template_kwargs or {})
    for name in extra:
        if name in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs.{name}: reserved; use the request "
                             f"field of that name, if there is one")
    template = resolve_template(tokenizer, chat_template, tools)
    if content_format == "auto":
        content_format = detect_content_format(template)
    conversation = normalize_messages(messages, content_format)
    return conversation, {
        "chat_template": template, "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "tools": list(tools) if tools is not None else None,
        "documents": list(documents) if documents is not None else None,
        "tokenize": False, **extra}
