"""Pretrain a GPT-2 MoE model with Parm's dispatchers on Megatron-Core.

One process (CPU):
    python pretrain_scripts/pretrain_gpt2_moe.py --config configs/gpt2_tiny_moe.yaml \
        --data-path data/cache/gpt_text_document

One node, 4 ranks (torchrun; on CPU it uses gloo):
    torchrun --nproc-per-node 4 pretrain_scripts/pretrain_gpt2_moe.py \
        --config configs/gpt2_tiny_moe.yaml --tensor-model-parallel-size 2 \
        --expert-model-parallel-size 2 --sequence-parallel --moe-token-dispatcher-type parm_s2

Or the launchers: pretrain_scripts/run_local.sh (torchrun), gpt2_moe.sbatch (Slurm),
run_emulated.sh (the emulated multi-node cluster). Flags are Megatron-LM's; see --help.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from megatron_parm.training.arguments import parse_args  # noqa: E402
from megatron_parm.training.trainer import pretrain  # noqa: E402

if __name__ == "__main__":
    args = parse_args(model_type="gpt")  # all checks run here, before any process group
    pretrain(args)
