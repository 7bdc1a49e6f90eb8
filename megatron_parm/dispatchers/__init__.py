"""Parm's token dispatchers, by their --moe-token-dispatcher-type names."""

from megatron_parm.dispatchers.base import ParmTokenDispatcher
from megatron_parm.dispatchers.ds_baseline import DSBaselineTokenDispatcher
from megatron_parm.dispatchers.parm_auto import ParmAutoTokenDispatcher
from megatron_parm.dispatchers.parm_s1 import ParmS1TokenDispatcher
from megatron_parm.dispatchers.parm_s2 import ParmS2TokenDispatcher

# Megatron-Core's own values, handled by MoELayer itself.
NATIVE_DISPATCHERS = ("allgather", "alltoall")

PARM_DISPATCHERS = {
    "ds_baseline": DSBaselineTokenDispatcher,
    "parm_s1": ParmS1TokenDispatcher,
    "parm_s2": ParmS2TokenDispatcher,
    "parm": ParmAutoTokenDispatcher,  # the performance model picks parm_s1 or parm_s2
}

VALID_DISPATCHERS = NATIVE_DISPATCHERS + tuple(PARM_DISPATCHERS)

__all__ = [
    "ParmTokenDispatcher",
    "DSBaselineTokenDispatcher",
    "ParmS1TokenDispatcher",
    "ParmS2TokenDispatcher",
    "ParmAutoTokenDispatcher",
    "NATIVE_DISPATCHERS",
    "PARM_DISPATCHERS",
    "VALID_DISPATCHERS",
]
