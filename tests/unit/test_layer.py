"""ParmMoELayer's forward follows the installed Megatron-Core's MoELayer.forward."""

from __future__ import annotations

import hashlib
import inspect
import textwrap

from megatron.core import package_info
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_parm import layer


def test_upstream_forward_is_the_one_the_copy_follows():
    source = textwrap.dedent(inspect.getsource(MoELayer.forward))
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest == layer.UPSTREAM_FORWARD_SHA256, (
        f"Megatron-Core {package_info.__version__}'s MoELayer.forward is not the one "
        f"ParmMoELayer.forward was written against (Megatron-Core "
        f"{layer.UPSTREAM_FORWARD_VERSION}): compare the two, follow the change in "
        f"megatron_parm/layer.py, then set UPSTREAM_FORWARD_VERSION and "
        f"UPSTREAM_FORWARD_SHA256 = {digest!r} there")


def test_the_copy_refuses_partial_execution_maps():
    """The copy refuses a shortened fwd_execution_map (partial CUDA-graph capture) by comparing
    it with FULL_EXECUTION_MAP: that must stay what MoELayer sets for a whole layer."""
    assert 'self.fwd_execution_map = ["route", "expert_compute", "postprocess"]' in \
        inspect.getsource(MoELayer.__init__)
    assert layer.FULL_EXECUTION_MAP == ["route", "expert_compute", "postprocess"]
