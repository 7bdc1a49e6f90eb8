"""Pretraining on Megatron-Core: arguments, models, the loop, logging.

    arguments  Megatron-LM's flags (+ --parm-*, --config YAML), validated before any process group
    model      GPTModel / BertModel with ParmMoELayer, and their forward steps
    trainer    pretrain(args): DDP, Adam, clipping, LR schedule, micro-batches, eval, checkpoints
    log        Megatron-LM's console line format and training_log (the line, TensorBoard, W&B),
               progress bar; what it logs: writers (TensorBoard, W&B), timers (Megatron-Core's),
               flops (--log-throughput), params_norm, memory, moe_log (router losses),
               progress_log (progress.txt)
    mixed_precision  --bf16 / --fp16 and loss scaling: Float16Module, the optimizer's fields
    implementation   --transformer-impl / --moe-grouped-gemm: is the package there?
"""
