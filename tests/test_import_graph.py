"""The package's import graph, read from the source with ast (nothing is imported): no cycle between mars
modules, counting imports inside functions (a lazy import hides a circle, it does not remove it), and the
server never reaching into evaluation (what both need lives below both)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in (SRC / "mars").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _imports(name: str, path: Path, package: bool, modules) -> set[str]:
    """The mars modules ``name`` imports anywhere in its body (``from a import b`` counts as ``a.b`` when
    that is a module, else as ``a``)."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    here = name if package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names if a.name.split(".")[0] == "mars"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "mars":
                continue
            found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else known(source) for a in node.names}
    return found - {None, name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, package, modules) for name, (path, package) in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_lazy_and_relative_imports(graph):
    # the checks below mean something only if imports inside functions and relative ones are found
    assert "mars.models" in graph["mars.training.self_distill"]  # inside model_fingerprint
    assert "mars.serving.policy" in graph["mars.serving.config"]  # from .policy import ...
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle(graph):
    assert _cycles(graph) == []


def test_serving_never_imports_evaluation(graph):
    sideways = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith("mars.serving")
        for target in targets
        if target.startswith("mars.evaluation")
    )
    assert sideways == []
