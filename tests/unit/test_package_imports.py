"""The package's modules import each other without a circle (a module-level or a deferred
import inside a function alike): checkpointing/ once had paths <-> safe_load."""

from __future__ import annotations

import ast

from launch import REPO


def package_imports(package: str) -> dict:
    """{module: {modules of PACKAGE it imports, at any depth of its code}}."""
    root = REPO / package.replace(".", "/")
    paths = {".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
             for path in sorted(root.rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
                for alias in node.names:  # `from package import submodule` names the submodule
                    submodule = f"{node.module}.{alias.name}"
                    imported.add(submodule if submodule in paths else node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names if alias.name.startswith(package))
        graph[module] = {m for m in imported if m in paths and m != module}
    return graph


def circles(graph: dict) -> list:
    """Every import circle of GRAPH (as the list of its modules), by depth-first search."""
    found, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_checkpointing_has_no_import_circle():
    graph = package_imports("megatron_parm.checkpointing")
    # the package's __init__ re-exports its modules; the modules never import it back
    graph.pop("megatron_parm.checkpointing")
    assert "megatron_parm.checkpointing.errors" in graph
    assert circles(graph) == []
    assert not any("megatron_parm.checkpointing" in targets for targets in graph.values())
