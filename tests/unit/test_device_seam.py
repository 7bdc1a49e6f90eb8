"""The device seam (megatron_parm/device.py) is the only code that asks torch.cuda.

Scanned: the package, tools/ and pretrain_scripts/. Allowed: megatron_parm/device.py (the
seam) and megatron_parm/mcore_compat/ (the CPU redirects that replace parts of torch.cuda where it is absent). A direct
use is `torch.cuda...`, `from torch import cuda`, `import torch.cuda`, or a tensor's
`.cuda(...)` call.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import torch

from launch import REPO

SCANNED = ("megatron_parm", "tools", "pretrain_scripts")
ALLOWED = ("megatron_parm/device.py", "megatron_parm/mcore_compat/")


def direct_cuda_uses(source: str):
    """(line, text) of every direct use of torch.cuda in a module's source."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" \
                and isinstance(node.value, ast.Name) and node.value.id == "torch":
            uses.append((node.lineno, "torch.cuda"))
        elif isinstance(node, ast.ImportFrom) and node.module and \
                (node.module.startswith("torch.cuda") or
                 (node.module == "torch" and any(a.name == "cuda" for a in node.names))):
            uses.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names):
            uses.append((node.lineno, "import torch.cuda"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "cuda":
            uses.append((node.lineno, ".cuda(...)"))
    return uses


def test_scanner_finds_each_kind_of_use():
    source = ("import torch\nimport torch.cuda\nfrom torch import cuda\n"
              "torch.cuda.synchronize()\nx = torch.zeros(1).cuda()\n")
    assert sorted(direct_cuda_uses(source)) == [
        (2, "import torch.cuda"), (3, "from torch import ..."), (4, "torch.cuda"), (5, ".cuda(...)")]
    assert direct_cuda_uses("from megatron_parm import device\ndevice.synchronize()\n") == []


def test_nothing_outside_the_seam_asks_torch_cuda():
    offenders = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(ALLOWED):
                continue
            offenders += [f"{rel}:{line}: {kind}" for line, kind in direct_cuda_uses(path.read_text())]
    assert not offenders, "use megatron_parm.device instead:\n" + "\n".join(offenders)


def test_seam_on_this_machine():
    from megatron_parm import device

    if device.is_cuda():
        pytest.skip("CPU-only expectations")
    assert device.current() == device.HOST == torch.device("cpu")
    assert device.backend() == "gloo"
    assert device.max_memory_allocated() == 0 and device.get_rng_state() is None
    with device.sync_debug_mode("error"):  # nothing to do on CPU
        device.synchronize()
    timer = device.Timer().start()
    time.sleep(0.02)
    assert 0.015 < timer.stop() < 1.0
    x = torch.arange(3)
    assert device.to_host(x).device == device.HOST
