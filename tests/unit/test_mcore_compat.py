"""megatron_parm.mcore_compat: nothing patched on import, everything documented, idempotent."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys

import torch

from launch import REPO
from megatron_parm import mcore_compat


def test_import_patches_nothing():
    code = (
        "import torch, megatron_parm.mcore_compat, megatron_parm.layer, megatron_parm.specs\n"
        "from megatron.core.tensor_parallel import mappings\n"
        "assert megatron_parm.mcore_compat.applied() == []\n"
        "assert mappings._gather_along_first_dim.__module__ == 'megatron.core.tensor_parallel.mappings'\n"
        "try:\n"
        "    torch.cuda.current_device()\n"
        "    ok = torch.cuda.is_available()\n"
        "except Exception:\n"
        "    ok = True\n"
        "assert ok\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_redirect_is_documented():
    for name, redirect in mcore_compat.REDIRECTS.items():
        assert len(redirect.why) > 40, name
        assert re.search(r"\d+\.\d+", redirect.written_for), name
        assert (redirect.applied_by == mcore_compat.SETUP) == (not redirect.target), name
        if redirect.applied_by == mcore_compat.SETUP:
            assert callable(redirect.patch), name


def test_changes_made_elsewhere_are_where_the_table_says():
    """An entry whose change moved or went away fails here: its module no longer names the
    patched attribute (or the function the table points at)."""
    elsewhere = {name: r for name, r in mcore_compat.REDIRECTS.items()
                 if r.applied_by != mcore_compat.SETUP}
    assert {"writer_results_queue", "torchrun_agent", "grouped_gemm_check"} <= set(elsewhere)
    for name, redirect in elsewhere.items():
        source = inspect.getsource(importlib.import_module(redirect.applied_by))
        user = redirect.patch.__name__ if redirect.patch else redirect.target.rsplit(".", 1)[-1]
        assert user in source, f"{name}: {redirect.applied_by} does not use {user}"


def test_no_other_module_assigns_into_megatron_or_torch():
    """A new monkeypatch of Megatron-Core or torch.distributed goes into the table: outside
    the modules it names, no code assigns to an attribute of a module imported from them."""
    allowed = {r.applied_by for r in mcore_compat.REDIRECTS.values()} | {"megatron_parm.mcore_compat"}
    offenders = []
    for path in sorted((REPO / "megatron_parm").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        if module in allowed or module.startswith("megatron_parm.mcore_compat."):  # its package
            continue
        tree = ast.parse(path.read_text())
        patched_modules = {alias.asname or alias.name.split(".")[0]
                           for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                           and (node.module or "").startswith(("megatron.", "torch.distributed"))
                           for alias in node.names}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) \
                        and root.id in patched_modules:
                    offenders.append(f"{module}:{node.lineno}: {ast.unparse(target)}")
    assert not offenders, "list these in megatron_parm.mcore_compat.REDIRECTS:\n" + "\n".join(offenders)


def test_setup_applies_each_redirect_once():
    mcore_compat.setup()
    first = mcore_compat.applied()
    mcore_compat.setup()
    assert mcore_compat.applied() == first
    if not torch.cuda.is_available():
        assert set(first) == {name for name, r in mcore_compat.REDIRECTS.items()
                              if r.applied_by == mcore_compat.SETUP}
        assert torch.cuda.current_device() == torch.device("cpu")
