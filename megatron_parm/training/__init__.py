"""Pretraining on Megatron-Core: arguments, models, the loop, logging.

    arguments  Megatron-LM's flags (+ --parm-*, --config YAML), validated before any process group
    model      GPTModel / BertModel with ParmMoELayer, and their forward steps
    trainer    pretrain(args): DDP, Adam, clipping, LR schedule, micro-batches, eval, checkpoints
    log        Megatron-LM's console line format, TensorBoard, progress bar
    mixed_precision  --bf16 / --fp16 and loss scaling: Float16Module, the optimizer's fields
    implementation   --transformer-impl / --moe-grouped-gemm: is the package there?
"""
