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


DESIGN = REPO / "docs" / "design.md"


def layer_table() -> dict:
    """{unit: layer} from docs/design.md's table of the packages by layer (a unit is a module or
    package of megatron_parm, named without the package's prefix)."""
    import re

    text = DESIGN.read_text()
    table = text[text.index("<!-- package-layers: begin"):text.index("<!-- package-layers: end")]
    layers = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].isdigit():
            for unit in re.findall(r"`([\w.]+)`", cells[1]):
                layers[unit] = int(cells[0])
    return layers


def unit_of(module: str, layers: dict) -> str:
    """The most specific unit of the table that holds a module (``data.vocab`` before ``data``)."""
    name = module.removeprefix("megatron_parm").lstrip(".")
    units = [u for u in layers if name == u or name.startswith(u + ".")]
    return max(units, key=len) if units else name


def test_every_import_goes_to_its_own_layer_or_below():
    layers = layer_table()
    assert len(layers) >= 20 and layers["schedules"] == 1 and layers["bench"] == max(layers.values())
    graph = package_imports("megatron_parm")
    # the package's __init__ imports nothing of it and holds only __version__, which any
    # layer may read
    graph.pop("megatron_parm")
    graph = {module: targets - {"megatron_parm"} for module, targets in graph.items()}
    unplaced = sorted({unit_of(m, layers) for m in graph} - set(layers))
    assert not unplaced, f"modules in no layer of docs/design.md's table: {unplaced}"
    upward = sorted((source, target) for source, targets in graph.items() for target in targets
                    if layers[unit_of(target, layers)] > layers[unit_of(source, layers)])
    assert not upward, f"imports of a higher layer (docs/design.md, the packages by layer): {upward}"
    assert circles(graph) == []
