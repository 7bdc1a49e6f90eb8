"""megatron_parm.mcore_compat: nothing patched on import, everything documented, idempotent."""

from __future__ import annotations

import subprocess
import sys

import torch

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
    assert set(mcore_compat._PATCHES) == set(mcore_compat.REDIRECTS)
    assert all(len(why) > 40 for why in mcore_compat.REDIRECTS.values())


def test_setup_applies_each_redirect_once():
    mcore_compat.setup()
    first = mcore_compat.applied()
    mcore_compat.setup()
    assert mcore_compat.applied() == first
    if not torch.cuda.is_available():
        assert set(first) == set(mcore_compat._PATCHES)
        assert torch.cuda.current_device() == torch.device("cpu")
