"""The multi-token prediction flags (DeepSeek-V3's MTP, Megatron-Core's MultiTokenPredictionBlock)."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_number, positive_int

GROUP = "multi-token prediction"


def flags() -> List[Flag]:
    return [
        Flag("--mtp-num-layers", GROUP, check=positive_int,
             help="GPT: multi-token prediction layers after the model (Megatron-Core's MTP "
                  "block, DeepSeek-V3's): the k-th predicts the token k + 1 places ahead from "
                  "the previous depth's output and that token's embedding, through one more "
                  "transformer layer of the last layer's kind and the shared output layer; its "
                  "loss is logged as 'mtp_k loss'."),
        Flag("--mtp-loss-scaling-factor", GROUP, check=non_negative_number,
             help="The weight of the multi-token prediction losses (their mean over the MTP "
                  "layers) added to the language-model loss (default %(default)s)."),
        Flag("--mtp-standalone", GROUP,
             help="The pipeline's sends exchange their shapes first, as they must where the "
                  "MTP layers have a stage of their own; set from --pipeline-model-parallel-"
                  "layout when one is given (Megatron-Core's mtp_standalone)."),
    ]
