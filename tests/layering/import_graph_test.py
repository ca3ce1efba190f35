"""python/llmq's import graph has no cycle, and no module imports from its own package's __init__.

Every import counts, at module level or inside a function (a deferred import is still a dependency:
it only hides a cycle until the call). `from pkg import name` is an edge to the submodule pkg.name when
there is one, else to pkg's __init__. A module inside a package that imports its package's
__init__ (``from llmq.quant import X`` inside llmq/quant) depends on everything that __init__ pulls in,
the usual way a cycle starts: it names the module that defines X instead.
"""

import ast
import os
from pathlib import Path
from typing import Dict, List, Set, Tuple


def _core_root() -> Path:
    return Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "python"


def _core_graph():
    graph, packages = import_graph(_core_root())
    assert {"llmq.quant.formats", "llmq.export", "llmq.checkpoint"} <= set(graph), "the sources were not found"
    return graph, packages


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool, modules: Set[str]) -> List[Tuple[str, int, str]]:
    """(target module, line, the import as written) for every import of a module in `modules`."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    out.append((alias.name, node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else base
                if target in modules:
                    out.append((target, node.lineno, f"from {base} import {alias.name}"))
    return out


def import_graph(root: Path) -> Tuple[Dict[str, List[Tuple[str, int, str]]], Dict[str, bool]]:
    """module -> its imports of other modules under root (tests left out), and module -> is a package."""
    files = {p for p in root.rglob("*.py") if not p.name.endswith("_test.py")}
    names = {_module_name(root, p): p for p in files}
    names.pop("", None)  # an __init__.py at the root itself
    packages = {n: p.name == "__init__.py" for n, p in names.items()}
    graph = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = _imports(tree, name, packages[name], set(names))
    return graph, packages


def cycles(graph: Dict[str, List[Tuple[str, int, str]]]) -> List[List[str]]:
    """The strongly connected components with more than one module (or a module importing itself)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan, iterative over a module's edges through recursion depth ~ graph depth
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or any(t == v for t, _, _ in graph.get(v, ())):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def own_package_imports(graph, packages) -> List[str]:
    """`from <an enclosing package> import X` (X not a submodule) in a module other modules import: an
    import of that package's __init__, which imports its submodules. Entry points (modules nothing
    imports: benchmarks, command lines) and __init__ files that import nothing are left out."""
    imported = {t for edges in graph.values() for t, _, _ in edges}
    out = []
    for module, edges in graph.items():
        if module not in imported:
            continue
        parts = module.split(".")
        enclosing = {".".join(parts[:i]) for i in range(1, len(parts))}
        if packages[module]:
            enclosing.add(module)
        for target, line, text in edges:
            if target in enclosing and packages.get(target) and graph.get(target):
                out.append(f"{module} line {line}: {text}")
    return out


def _describe(comp, graph) -> str:
    members = set(comp)
    edges = [f"  {m} -> {t} (line {line}: {text})" for m in comp for t, line, text in graph[m] if t in members]
    return f"cycle of {len(comp)} modules:\n" + "\n".join(edges)


def test_no_import_cycle_in_the_core():
    graph, _ = _core_graph()
    found = cycles(graph)
    assert not found, "\n".join(_describe(c, graph) for c in found)


def test_no_module_imports_its_own_package_init():
    graph, packages = _core_graph()
    bad = own_package_imports(graph, packages)
    assert not bad, "import the defining module instead of the package's __init__:\n" + "\n".join(bad)


def _graph_of(tmp_path, files):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path)


def test_the_checks_see_a_cycle_and_an_own_package_import(tmp_path):
    graph, packages = _graph_of(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "def f():\n    from pkg.b import g\n    return g\n",
        "pkg/b.py": "from pkg import f\n",
        "pkg/c.py": "from pkg import a\nimport pkg.b as b\n",
        "pkg/main.py": "from pkg import f\n",  # an entry point: nothing imports it
    })
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b"]]
    assert own_package_imports(graph, packages) == ["pkg.b line 1: from pkg import f"]
    graph, packages = _graph_of(tmp_path / "fixed", {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "def f():\n    from pkg.b import g\n    return g\n",
        "pkg/b.py": "def g():\n    return 1\n",
    })
    assert cycles(graph) == [] and own_package_imports(graph, packages) == []
