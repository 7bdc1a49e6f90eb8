"""The optimizer flags: which of Megatron-Core 0.16.1's optimizers (training/optimizer.py builds
it), its hyperparameters, and which parameters take weight decay."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_number

GROUP = "optimizer"
# Megatron-Core 0.16.1's choices that run here; muon and dist_muon are its Muon
# (megatron/core/optimizer/muon.py), built on the emerging_optimizers package.
OPTIMIZERS = ("adam", "sgd")
MUON_UNAVAILABLE = ("Megatron-Core 0.16.1's Muon needs the emerging_optimizers package, whose "
                    "only release needs Python 3.12 (this project runs on Python 3.10 and 3.11)")


def flags() -> List[Flag]:
    return [
        Flag("--optimizer", GROUP, supported=OPTIMIZERS, unsupported=MUON_UNAVAILABLE,
             help="adam: Adam with decoupled weight decay (AdamW; torch's, or Apex's or "
                  "Transformer Engine's fused one where installed); sgd: SGD with momentum "
                  "(--sgd-momentum). muon and dist_muon are refused here."),
        Flag("--adam-beta1", GROUP),
        Flag("--adam-beta2", GROUP),
        Flag("--adam-eps", GROUP),
        Flag("--sgd-momentum", GROUP, check=non_negative_number),
        Flag("--apply-wd-to-qk-layernorm", GROUP,
             help="Also decay the query and key layernorms' weights (--qk-layernorm); by "
                  "default no 1-D parameter and no bias takes weight decay."),
        Flag("--no-weight-decay-cond-type", GROUP,
             help="Deprecated in Megatron-LM: apply_wd_to_qk_layernorm is "
                  "--apply-wd-to-qk-layernorm."),
    ]
