"""The package's layers point down only: its import graph (every import, at module level or inside a
function) has no cycle, and no module imports from a layer above its own."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "numattn"

# lowest first; a module may import from its own layer and the ones below
LAYERS = [
    ("numattn._cuda", "numattn._version", "numattn._arrays", "numattn.reference"),
    ("numattn.kernels",),
    ("numattn.configs",),
    ("numattn.tuning",),
    ("numattn.ops",),
    ("numattn.search",),
    ("numattn.torch", "numattn.precompile", "numattn.bench", "numattn.__main__"),
]


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path):
    """The numattn modules that ``path`` imports, anywhere in it (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("numattn"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if not base.startswith("numattn"):
                continue
            for alias in node.names:  # ``from . import cache`` names a module; ``from .x import f`` a name of x
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    return {target for target in found if target in MODULES}


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {name: imports(path) - {name} for name, path in MODULES.items()}


def layer(name):
    for rank, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    return len(LAYERS)  # the package's own namespace, numattn/__init__.py: the top


def test_every_module_has_a_layer():
    assert [name for name in MODULES if layer(name) == len(LAYERS) and name != "numattn"] == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                    if layer(b) > layer(a) and not (b == "numattn" and layer(a) == len(LAYERS) - 1))
    assert upward == []


def test_no_import_cycles():
    """Depth-first search over the whole graph, the package's namespace module (``numattn``, which re-exports
    the public API) included: a face may call it only if the namespace does not import that face."""
    graph = GRAPH
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


@pytest.mark.parametrize("relative, expected", [("ops/attention.py", "numattn.tuning.store"),
                                                ("search/__init__.py", "numattn.search.pipeline")])
def test_the_graph_sees_relative_and_package_imports(relative, expected):
    assert expected in GRAPH[module_name(PACKAGE / relative)]
