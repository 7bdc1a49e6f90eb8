"""megatron_parm.platform: nothing patched on import, everything documented, idempotent."""

from __future__ import annotations

import subprocess
import sys

import torch

from megatron_parm import platform


def test_import_patches_nothing():
    code = (
        "import torch, megatron_parm.platform, megatron_parm.layer, megatron_parm.specs\n"
        "from megatron.core.tensor_parallel import mappings\n"
        "assert megatron_parm.platform.applied() == []\n"
        "assert mappings._gather_along_first_dim.__module__ == 'megatron.core.tensor_parallel.mappings'\n"
        "try:\n"
        "    torch.cuda.current_device()\n"
        "    ok = torch.cuda.is_available()\n"
        "except Exception:\n"
        "    ok = True\n"
        "assert ok\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_redirect_is_documented():
    assert set(platform._PATCHES) == set(platform.REDIRECTS)
    assert all(len(why) > 40 for why in platform.REDIRECTS.values())


def test_setup_applies_each_redirect_once():
    platform.setup()
    first = platform.applied()
    platform.setup()
    assert platform.applied() == first
    if not torch.cuda.is_available():
        assert set(first) == set(platform._PATCHES)
        assert torch.cuda.current_device() == torch.device("cpu")
