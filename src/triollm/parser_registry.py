"""Parsers by name, for the tool-call and reasoning parser managers (vLLM's
``ToolParserManager`` and ``ReasoningParserManager`` keep their own class-level names and
delegate here), and the plugin files that register more."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

__all__ = ["ParserRegistry", "run_plugin_file"]

_Base = TypeVar("_Base")
_Class = TypeVar("_Class", bound=type)


class ParserRegistry(Generic[_Base]):
    """Subclasses of ``base`` by name; ``kind`` names them in errors ("tool parser")."""

    def __init__(self, kind: str, base: type[_Base]) -> None:
        self.kind = kind
        self.base = base
        self.parsers: dict[str, type[_Base]] = {}

    def get(self, name: str) -> type[_Base]:
        """The parser registered as ``name``; ``KeyError`` listing the known ones."""
        try:
            return self.parsers[name]
        except KeyError:
            known = ", ".join(sorted(self.parsers))
            raise KeyError(f"{self.kind} {name!r} is not registered (known: {known})") from None

    def register(self, name: str | Sequence[str] | None, force: bool
                 ) -> Callable[[_Class], _Class]:
        """A decorator registering a parser class under ``name`` (or names; None: its
        class name). Without ``force`` a name already taken is a ``KeyError``."""

        def register(parser: _Class) -> _Class:
            checked = self._checked(parser)
            names = [parser.__name__] if name is None else (
                [name] if isinstance(name, str) else list(name))
            for each in names:
                if not force and each in self.parsers:
                    raise KeyError(f"{self.kind} {each!r} is already registered")
                self.parsers[each] = checked
            return parser

        return register


    def _checked(self, parser: object) -> type[_Base]:
        if not (isinstance(parser, type) and issubclass(parser, self.base)):
            raise TypeError(f"{parser!r} is not a {self.base.__name__} subclass")
        return parser


def run_plugin_file(path: str) -> None:
    """Run the Python file ``path`` as a module named after it, as vLLM's plugin flags do
    (its ``register_module`` calls add parsers). ``ValueError`` if it cannot be loaded;
    what the file itself raises propagates."""
    file = Path(path)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    if spec is None or spec.loader is None or not file.is_file():
        raise ValueError(f"cannot load {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
