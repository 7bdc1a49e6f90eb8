"""Pretrain a BERT MoE model (masked LM + next-sentence prediction) with Parm's dispatchers on Megatron-Core.

One process (rank 0 of 1; gloo on CPU, NCCL on a GPU):
    python pretrain_scripts/pretrain_bert_moe.py --config configs/bert_tiny_moe.yaml \
        --data-path data/cache/bert_text_sentence

One node, 4 ranks (megatron_parm.launch is torchrun with one-line errors and clean
stops; plain torchrun works too; on CPU it uses gloo):
    python -m megatron_parm.launch --nproc-per-node 4 pretrain_scripts/pretrain_bert_moe.py \
        --config configs/bert_tiny_moe.yaml --tensor-model-parallel-size 2 \
        --expert-model-parallel-size 2 --sequence-parallel --moe-token-dispatcher-type parm_s2

Or the launchers: pretrain_scripts/run_local.sh (torchrun), bert_moe.sbatch (Slurm),
run_emulated.sh (the emulated multi-node cluster). Flags are Megatron-LM's; see --help.
"""

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.training import trainer  # noqa: E402

# main(argv=None): all but the model is shared (training.trainer.main)
main = functools.partial(trainer.main, "bert")

if __name__ == "__main__":
    cli.run(main)
