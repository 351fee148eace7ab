"""The package's layering, checked on the source: which module may import what.

Imports are read with ``ast`` from every module under src/triollm, including imports
inside functions (a lazy import is still an arrow). What a module reaches at run time
leaves out imports under ``if TYPE_CHECKING:``, which never run; the cycle check counts
them too, since a type-only cycle is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

import triollm

SRC = Path(triollm.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def runtime_nodes(tree: ast.AST, *, type_checking: bool = False) -> list[ast.AST]:
    """All nodes except those under ``if TYPE_CHECKING:`` (with ``type_checking``, all)."""
    nodes: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if (not type_checking and isinstance(node, ast.If)
                and getattr(node.test, "id", None) == "TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


@cache
def direct_imports(module: str, *, type_checking: bool = False) -> frozenset[str]:
    """What ``module`` imports at run time (with ``type_checking``, for the type checker
    too): ``from a.b import c`` counts as ``a.b.c`` when that is one of our modules,
    else as ``a.b``."""
    found: set[str] = set()
    tree = ast.parse(MODULES[module].read_text())
    for node in runtime_nodes(tree, type_checking=type_checking):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{module}: relative import"
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return frozenset(found)


def imported_modules(module: str) -> set[str]:
    """Everything ``module`` imports, following our own modules transitively."""
    seen: set[str] = set()
    found: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in direct_imports(name):
            found.add(imported)
            if imported in MODULES:
                todo.append(imported)
    return found


def forbidden(module: str, roots: tuple[str, ...]) -> list[str]:
    """What ``module`` reaches, directly or not, that starts with one of ``roots``."""
    return sorted(m for m in imported_modules(module)
                  if any(m == root or m.startswith(root + ".") for root in roots))


def modules_under(prefix: str) -> list[str]:
    return [m for m in MODULES if m.startswith(prefix)]


EVENT_LOOPS = ("anyio", "trio", "asyncio", "sniffio")


@pytest.mark.parametrize("module", [
    "triollm.step", "triollm.config", "triollm.errors", "triollm.sampling_params",
    "triollm.outputs", "triollm.engine.request", "triollm.engine.scheduler",
    "triollm.engine.block_manager", "triollm.engine.step_time", "triollm.engine.detokenizer",
    "triollm.engine.inputs", "triollm.entrypoints.chat_utils", "triollm.engine.output_processor",
    "triollm.engine.stats", "triollm.pooling_params", "triollm.entrypoints.score_utils",
    "triollm.lora.request", "triollm.request_ids", "triollm.engine.request_registry",
    "triollm.engine.lora_registry", "triollm.engine.stats_collector", "triollm.engine.intake",
    "triollm.engine.step_budget", "triollm.engine.stop_strings",
    "triollm.engine.speculative.ngram", "triollm.engine.speculative.speculator",
    "triollm.server.tokenizer_process", "triollm.structured_output",
    "triollm.structured_output.params", "triollm.structured_output.grammar",
    "triollm.structured_output.reasoning_gate", "triollm.structured_output.backend",
    *modules_under("triollm.tool_parsers"), *modules_under("triollm.reasoning"),
    "triollm.entrypoints.openai.tool_parsers", "triollm.parser_registry",
])
def test_scheduling_code_imports_neither_torch_nor_an_event_loop(module: str) -> None:
    assert forbidden(module, ("torch", "transformers", *EVENT_LOOPS)) == []


@pytest.mark.parametrize("module", [
    *modules_under("triollm.model"), "triollm.engine.core", "triollm.engine.args",
    "triollm.engine.resolve", "triollm.engine.assembly", "triollm.llm",
    *modules_under("triollm.server.protocol"),
])
def test_model_and_sync_engine_code_never_import_an_event_loop(module: str) -> None:
    assert forbidden(module, EVENT_LOOPS) == []


ASYNC_MODULES = {"triollm", "triollm.cli", "triollm.engine.async_engine",
                 "triollm.engine.async_api", "triollm.engine.async_requests",
                 "triollm.engine.channel", "triollm.engine.worker",
                 *modules_under("triollm.engine.process"), *modules_under("triollm.server")}


@pytest.mark.parametrize("module", sorted(set(MODULES) - ASYNC_MODULES))
def test_only_the_async_layer_and_the_server_touch_an_event_loop(module: str) -> None:
    """Directly: the package root and the CLI reach the async engine, but use no loop."""
    assert sorted(m for m in direct_imports(module) if m.split(".")[0] in EVENT_LOOPS) == []


@pytest.mark.parametrize("module", modules_under("triollm.model"))
def test_the_model_layer_knows_neither_the_engine_nor_the_server(module: str) -> None:
    assert forbidden(module, ("triollm.engine", "triollm.server", "triollm.llm")) == []


@pytest.mark.parametrize("module", modules_under("triollm.engine"))
def test_the_engine_never_imports_the_server(module: str) -> None:
    assert forbidden(module, ("triollm.server", "triollm.cli")) == []


LIGHT_MODULES = ("triollm.config", "triollm.errors", "triollm.sampling_params",
                 "triollm.outputs")


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_the_plain_data_modules_import_neither_torch_nor_transformers(module: str) -> None:
    """What users and the server read without a model (configs, errors, parameters,
    outputs) loads no framework: torch and transformers appear in annotations only."""
    assert forbidden(module, ("torch", "transformers", "triollm.model")) == []


def test_importing_the_plain_data_modules_loads_no_framework() -> None:
    """The same, as Python sees it: the package root comes with them, so it must stay
    light too (``triollm serve --help`` loads no model framework)."""
    code = (f"import sys; import {', '.join(LIGHT_MODULES)}; "
            f"print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC.parent)}, check=True)
    assert result.stdout.strip() == "[]"


def test_errors_and_step_import_nothing_of_ours_beyond_their_layer() -> None:
    assert forbidden("triollm.errors", ("torch", "transformers", "triollm")) == []
    assert forbidden("triollm.step", ("triollm.engine", "triollm.model")) == []


@pytest.mark.parametrize("type_checking", [False, True],
                         ids=["at-run-time", "with-type-checking-imports"])
def test_there_is_no_import_cycle(type_checking: bool) -> None:
    graph = {m: sorted(i for i in direct_imports(m, type_checking=type_checking)
                       if i in MODULES) for m in MODULES}
    path: list[str] = []
    on_path: set[str] = set()
    done: set[str] = set()

    def visit(module: str) -> None:
        path.append(module)
        on_path.add(module)
        for imported in graph[module]:
            if imported in on_path:
                cycle = [*path[path.index(imported):], imported]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if imported not in done:
                visit(imported)
        on_path.discard(path.pop())
        done.add(module)

    for module in graph:
        if module not in done:
            visit(module)
    assert len(done) == len(MODULES) > 40


def test_the_checks_see_real_imports() -> None:
    """The checks above would pass vacuously if the import reader found nothing."""
    assert "torch" in forbidden("triollm.model.sampler", ("torch",))
    assert "triollm.engine.core" in direct_imports("triollm.engine.assembly")
    assert "triollm.server.routes.chat" in direct_imports("triollm.server.app")
    assert "triollm.model.loader" in direct_imports("triollm.engine.args")  # a lazy import
    assert "anyio" in direct_imports("triollm.engine.channel")
    # A TYPE_CHECKING-only import is an arrow for the type checker only.
    assert "triollm.engine.async_engine" not in direct_imports("triollm.server.engine_kind")
    assert "triollm.engine.async_engine" in direct_imports("triollm.server.engine_kind",
                                                            type_checking=True)
