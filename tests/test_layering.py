"""The package's import graph: no cycle, and no import from a lower layer to a higher one.

Read with ``ast`` (every ``import`` in a module, at the top or inside a function, counts), so the
test needs no import of the package. The layers follow the request's path (docs: STYLE.md's house):
leaves (errors, units, metrics, batch), the pure-Python specs, the backend choice and the kernels,
the models, the KV tiers, then the engine hop by hop (request -> sampling -> input -> scheduler ->
runner -> output -> stream -> engine), the offline API, the package's re-exports, the server and
the CLI on top. A module may import its own layer or any below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "pagedkv_rs"

# lowest first; a module belongs to the layer of its longest matching prefix
LAYERS: list[tuple[str, ...]] = [
    ("pagedkv_rs.errors", "pagedkv_rs.units", "pagedkv_rs.metrics", "pagedkv_rs.batch", "pagedkv_rs._core"),
    ("pagedkv_rs.fallback", "pagedkv_rs.kernels.reference"),
    ("pagedkv_rs._backend",),
    ("pagedkv_rs.kernels",),
    ("pagedkv_rs.models",),
    ("pagedkv_rs.tiers",),
    ("pagedkv_rs.engine.structured", "pagedkv_rs.engine.pooling"),
    ("pagedkv_rs.engine.request",),
    ("pagedkv_rs.engine.sampling",),
    ("pagedkv_rs.engine.speculative",),
    ("pagedkv_rs.engine.input",),
    ("pagedkv_rs.engine.scheduler",),
    ("pagedkv_rs.engine.runner", "pagedkv_rs.engine.draft"),
    ("pagedkv_rs.engine.output",),
    ("pagedkv_rs.engine.stream",),
    ("pagedkv_rs.engine.engine",),
    ("pagedkv_rs.engine",),
    ("pagedkv_rs.llm",),
    ("pagedkv_rs",),
    ("pagedkv_rs.serve",),
    ("pagedkv_rs.cli",),
]
ENGINE_MAX_LINES = 420


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports (``from pkg import submodule`` counts as the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in MODULES or sub == "pagedkv_rs._core" else mod)
    return {m for m in found if m == "pagedkv_rs" or m.startswith("pagedkv_rs.")} - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(module: str) -> int:
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS"
    return rank


def test_every_module_has_a_layer():
    for m in MODULES:
        layer(m)


def test_no_import_goes_up_a_layer():
    up = [
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, deps in GRAPH.items()
        for d in sorted(deps)
        if layer(d) > layer(m)
    ]
    assert not up, "\n".join(up)


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> imported modules), or []."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return []


def test_no_import_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    cycle = find_cycle(GRAPH)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_layering_test_sees_real_edges():
    """The graph is read right: edges this layout is known to have are found."""
    assert "pagedkv_rs.engine.input" in GRAPH["pagedkv_rs.engine.scheduler"]
    assert "pagedkv_rs.kernels" in GRAPH["pagedkv_rs.engine.runner"]
    assert "pagedkv_rs.metrics" in GRAPH["pagedkv_rs.tiers.base"]
    assert layer("pagedkv_rs.engine.engine") > layer("pagedkv_rs.engine.runner") > layer("pagedkv_rs.tiers")


def test_engine_py_is_the_loop_only():
    n = len((PACKAGE / "engine" / "engine.py").read_text().splitlines())
    assert n <= ENGINE_MAX_LINES, f"engine/engine.py has {n} lines: move what is not the loop to its hop"
