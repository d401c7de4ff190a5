"""The import rule of docs/architecture.md, checked on the project's own import graph.

Layers, lowest first: ``kernels/`` < ``shared/`` < ``encoder_svc/``, ``decoder_svc/``, ``gateway_svc/`` < ``encdec/``.
A package imports only from layers below it (and itself); the services never import each other (the HTTP gateway
holds no model: it needs neither kernels nor a service's code); no import circle
between modules; the scheduler and block manager load without torch. Every import counts, also one inside a
function (a lazy import still ties the modules together). The graph is read from the source with ``ast``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "shared", "encoder_svc", "decoder_svc", "gateway_svc", "encdec")
# What each package may import from the project besides itself.
ALLOWED = {
    "kernels": set(),
    "shared": {"kernels"},
    "encoder_svc": {"kernels", "shared"},
    "decoder_svc": {"kernels", "shared"},
    "gateway_svc": {"shared"},
    "encdec": {"kernels", "shared", "encoder_svc", "decoder_svc", "gateway_svc"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.parent.name == "proto" and path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # generated at install time
            found[_module_name(path)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to: itself, or its longest prefix that is a module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for target in names:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    targets.add(resolved)
        graph[name] = targets
    return graph


def _package(module: str) -> str:
    return module.split(".", 1)[0]


def test_no_import_runs_back_up_or_across():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the project
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if _package(target) != _package(module) and _package(target) not in ALLOWED[_package(module)]
    )
    assert not wrong, "imports against the layering of docs/architecture.md:\n" + "\n".join(wrong)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    circles = _circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", ["decoder_svc.core.scheduler", "decoder_svc.core.block_manager"])
def test_scheduler_and_block_manager_load_without_torch(module):
    code = f"import sys; sys.modules['torch'] = None; import {module}"  # None: any 'import torch' raises ImportError
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
