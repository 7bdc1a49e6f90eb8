"""Parm's token dispatchers, by their --moe-token-dispatcher-type names.

Which class runs a name is the schedule catalog's fact (megatron_parm/schedules.py, the
entry's ``dispatcher``); this package only resolves it.
"""

from __future__ import annotations

import importlib

from megatron_parm import schedules
from megatron_parm.dispatchers.base import ParmTokenDispatcher


def dispatcher_class(name: str) -> type:
    """The ParmTokenDispatcher subclass of a schedule: a non-native one's, or the one through
    which `parm` runs one of Megatron's (ValueError for unknown names and for Megatron's
    others, which only MoELayer builds)."""
    schedule = schedules.get(name)
    if schedule.dispatcher is None:
        raise ValueError(f"{name} is Megatron-Core's own dispatcher: MoELayer builds it")
    module_name, _, class_name = schedule.dispatcher.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, ParmTokenDispatcher)):
        raise TypeError(f"schedule {name!r}: {schedule.dispatcher} is not a ParmTokenDispatcher")
    return cls


def build_dispatcher(name: str, num_local_experts: int, local_expert_indices, config,
                     pg_collection=None) -> ParmTokenDispatcher:
    """The dispatcher of a schedule with a dispatcher class (dispatcher_class), knowing its
    catalog entry (``.schedule``: its capabilities, e.g. whether ParmMoELayer may run it as one
    pipelined call)."""
    dispatcher = dispatcher_class(name)(num_local_experts, local_expert_indices, config=config,
                                        pg_collection=pg_collection)
    dispatcher.schedule = schedules.get(name)
    return dispatcher


__all__ = ["ParmTokenDispatcher", "build_dispatcher", "dispatcher_class"]
