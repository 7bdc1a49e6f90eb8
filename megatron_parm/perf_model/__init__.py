"""Alpha-beta performance model of Parm's dispatchers (pure Python, no process groups).

    from megatron_parm.perf_model import Layout, LayerShape, load_profile, choose_schedule
    layout = Layout(tp=2, ep=2, etp=2, nodes=2, ranks_per_node=2)
    shape = LayerShape(num_tokens=1024, hidden_size=512, ffn_hidden_size=256,
                       num_experts=4, topk=2, dtype_bytes=4)
    profile = load_profile("emulated_pcie")   # a path, or a shipped profile's name
    choice = choose_schedule(shape, layout, profile)   # "parm_s1" or ("parm_s2", c_fwd, c_bwd)

layout.py: ranks, groups, intra/inter peers; shape.py: the layer's sizes and routed rows;
volumes.py: each dispatcher's stages and bytes; profile.py: alpha/beta files;
predict.py: stage times, the S2 pipeline, the choice.
"""

from megatron_parm.perf_model.layout import GROUP_NAMES, Layout
from megatron_parm.perf_model.predict import (Choice, Prediction, StageTime, choose_schedule,
                                              predict, schedule_label)
from megatron_parm.perf_model.profile import (LINKS, Profile, fit_alpha_beta, load_profile,
                                              save_profile)
from megatron_parm.perf_model.shape import LayerShape
from megatron_parm.perf_model.volumes import Step, build_plan, comm_volumes, modelled_dispatchers
from megatron_parm.schedules import COLLECTIVE_KINDS

__all__ = [
    "COLLECTIVE_KINDS", "Choice", "GROUP_NAMES", "LINKS", "LayerShape", "Layout",
    "Prediction", "Profile", "StageTime", "Step", "build_plan", "choose_schedule",
    "comm_volumes", "fit_alpha_beta", "load_profile", "modelled_dispatchers", "predict",
    "save_profile", "schedule_label",
]
