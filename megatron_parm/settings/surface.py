"""Megatron-LM's training flags this project does not implement, and why: which have no effect
here (said once at start-up) and which are refused (one `error:` line before any rank starts).
The classification of the whole flag surface is this file and the concern modules beside it:

    implemented     declared in a concern module (model.py, moe.py, ...), not listed here
    NO_EFFECT       accepted; their names and reasons are one line at start-up when given
    REFUSED         accepted by the parser; any value other than Megatron-LM's default is refused,
                    naming the flag and the reason

A flag is in exactly one of the three (tests/unit/test_flag_surface.py checks it against the
facts of megatron_lm_0_16_1.tsv), and docs/flags.md is generated from them
(tools/flag_table.py). Implementing a flag: declare it in its concern's module and delete its
line here. Each table is in Megatron-LM's order.
"""

from __future__ import annotations

from typing import Dict

# Why a flag has no effect here.
FUSED_KERNEL = "picks a fused GPU kernel, and the same computation runs unfused here"
GPU_MATH = "sets a cuBLAS math mode of the GPU"
GPU_OVERLAP = "overlaps or orders GPU work differently, with the same results"
TP_OVERLAP_OFF = "a setting of --tp-comm-overlap, which is off here (it needs Transformer Engine)"
NCCL = "tunes NCCL or its buffers (NCCL's defaults run on a GPU here, gloo on CPU)"
GPU_MEMORY = ("changes where or how long GPU memory is held (offloading, pinning, freeing), with "
              "the same results")
CUDA_GRAPHS_OFF = "a setting of CUDA graphs, which are off here"
FP8_OFF = "a setting of FP8 / FP4 training, which is off here"
FLEX_OFF = "a setting of the flex dispatcher (DeepEP / HybridEP), which is refused here"
MUON_OFF = "a setting of --optimizer muon / dist_muon, which is refused here"
FSDP2_OFF = "a setting of torch FSDP2, which is not built here (--use-megatron-fsdp is)"
FSDP_BUFFERS = ("sizes or keeps Megatron-FSDP's communication buffers (double buffering, the "
                "prefetch unit), with the same results: its defaults run here")
FSDP_CKPT_OFF = ("a setting of --ckpt-format fsdp_dtensor checkpoints, whose saving and loading "
                 "is not built here")
HSDP_OFF = ("a setting of hybrid sharded Megatron-FSDP (with --num-distributed-optimizer-instances "
            "> 1), which is refused here")
PRECISION_AWARE_OFF = ("a setting of --use-precision-aware-optimizer, which needs Transformer "
                       "Engine")
RELATIVE_OFF = "a setting of relative position embeddings (T5), which are not built here"
ALWAYS_MCORE = "always so here: Megatron-Core models and its distributed checkpoints"
PROFILING = ("GPU profiling (nsys, the PyTorch profiler, memory snapshots, energy) is not built "
             "here")
TELEMETRY = ("NVIDIA's telemetry services (one-logger, straggler detection, workload inspector) "
             "are not built here")
LOCAL_RANK = "torchrun's LOCAL_RANK is read instead"
STORAGE_CLIENT = "the multi-storage client is not used here: checkpoints and data are local files"
EXPERIMENTAL = "lets Megatron-Core's experimental features run, and none of them is built here"
INDEX_SPEED = "speeds up building or loading dataset indexes, which are built the same way here"
ASYNC_SAVE = ("writes checkpoints in the background, which is not built here: every save waits for "
              "its files, the same files (Megatron-LM 0.16.1 also saves in the foreground unless "
              "--use-persistent-ckpt-worker is given)")
DEPRECATED_FORMAT = ("deprecated in Megatron-LM 0.16.1, which ignores it too (--ckpt-format "
                     "chooses the format)")
PARALLEL_SAVE_DEFAULT = ("deprecated in Megatron-LM 0.16.1, which ignores it too: the parallel "
                         "save is the default (--no-ckpt-fully-parallel-save turns it off)")
READ_NOWHERE = "Megatron-LM 0.16.1 declares it and reads it nowhere"
LOCAL_CKPT_OFF = "a setting of local non-persistent checkpoints, which are refused here"
REPLICATION_OFF = "a setting of --replication, which is refused here"
EXPORT = "a setting of ONNX export, which is not built here"
GLOO = "the CPU runs here need their gloo groups (on a GPU they are made only where used)"
UNREAD = ("Megatron-LM core_v0.16.1 reads it nowhere: with --exit-signal-handler the data "
          "loader's workers catch --exit-signal anyway, there as here")
SAMPLE_RATE = ("Megatron-LM reads it only in its legacy ORQA (biencoder) datasets, not when it "
               "pretrains GPT or BERT")
DECODER_ONLY = ("the decoder's sequence length of encoder-decoder models (T5), which are not built "
                "here: GPT and BERT read --seq-length")
OBJECT_STORAGE = ("caches the indexes of data read from object storage (S3, the multi-storage "
                  "client), and the data here are local files")
HF_FAST = ("HuggingFaceTokenizer here always reads tokenizer.json with the tokenizers library (a "
           "fast tokenizer)")
HF_REMOTE_CODE = ("HuggingFaceTokenizer here reads tokenizer.json and never runs code of the "
                  "tokenizer's repository")
UNREAD_BY_CORE = ("Megatron-LM 0.16.1 hands it to no Megatron-Core code that reads it (only its "
                  "legacy models did), so it changes nothing there either")
ROPE_FACTOR = ("Megatron-LM 0.16.1's GPT builder does not pass it on: --use-rope-scaling scales by "
               "Megatron-Core's factor 8 there too")
T5_DECODER = "sets the decoder of T5 models, not built here: GPT and BERT take --num-layers"
QK_CLIP_OFF = "a setting of --qk-clip, which is refused here"

# Why a flag is refused.
NEEDS_TE = "needs Transformer Engine"
NEEDS_GPU_FP8 = "FP8 / FP4 training needs Transformer Engine on a Hopper or newer GPU"
CUDA_GRAPHS = ("CUDA graphs need a GPU, and Parm's dispatchers keep host state a graph cannot "
               "replay (docs/design.md)")
NEEDS_DEEPEP = "needs DeepEP, HybridEP or grouped_gemm kernels on a GPU"
HIERARCHICAL_CP = ("hierarchical context parallelism feeds --cp-comm-type a2a+p2p, which needs "
                   "Transformer Engine's attention (--context-parallel-size with all_gather or a2a "
                   "runs here)")
HYBRID_CP = ("hybrid (dynamic) context parallelism splits packed sequences (THD) over a varying "
             "number of ranks, which needs Transformer Engine's attention and is not built here "
             "(--context-parallel-size runs here)")
FSDP2 = ("torch FSDP2 is not built here (Megatron-FSDP is: --use-megatron-fsdp "
         "--data-parallel-sharding-strategy)")
META_INIT = ("building the model on the meta device and materializing it in FSDP's shards is not "
             "built here")
MAMBA = "Mamba and hybrid models are not built here"
LEGACY_MODELS = "Megatron-LM's legacy models are not built here, Megatron-Core's are"
RENAMED = "Megatron-LM refuses it too, its newer flag replaces it"
AUTORESUME = ("ADLR autoresume is NVIDIA's internal service (--exit-signal-handler and "
              "megatron_parm.launch --max-restarts resume here)")
INPROCESS = ("in-process restart is not built here (megatron_parm.launch --max-restarts restarts "
             "the job from its last checkpoint)")
FT_PACKAGE = ("NVIDIA's fault-tolerance package is not built here (docs/faults.md: what the "
              "launcher does)")
NOT_PRETRAINING = ("RL, vision, biencoder and SFT training are not this project's, which "
                   "pretrains GPT and BERT MoE models")
INFERENCE = "inference is not this project's, which pretrains GPT and BERT MoE models"
FULL_VALIDATION = ("an evaluation runs --eval-iters batches here, a pass over the whole "
                   "validation split is not built")
VALIDATION_SETS = ("an evaluation here takes the validation datasets as one blend, a loss for "
                   "each one is not built")
NOT_BUILT = "not built here yet"
REPLICATION = ("replicates local non-persistent checkpoints, which need NVIDIA's resiliency "
               "package (nvidia-resiliency-ext), not used here")
GRAD_FILES = ("writing gradients to files is not built here yet (checkpoints hold weights, "
              "optimizer state and RNG states)")
MAIN_PARAMS_FROM_CKPT = ("not built here yet: without the optimizer's state, a --bf16 / --fp16 "
                         "run's fp32 main parameters start from the loaded weights")
FIM = ("Megatron-LM's fill-in-the-middle dataset is in its training package, not in Megatron-Core "
       "0.16.1, and is not built here")
LEGACY_TOKENIZER = ("Megatron-LM's legacy tokenizer classes (megatron/training/tokenizer) are not "
                    "built here: the datasets use the tokenizer --tokenizer-type names")
TOKENIZER_METADATA = ("picks Megatron-Core's tokenizer library and class from a file, and the "
                      "tokenizers here are chosen by --tokenizer-type")
MAX_ATTENTION_LOGIT = ("Megatron-Core 0.16.1 measures the attention logits only in Transformer "
                       "Engine's attention (2.9 or newer), as Megatron-LM requires too")
QK_CLIP = ("needs Transformer Engine's attention (2.9 or newer), which records the largest "
           "attention logits that the clip scales the query and key weights by")
MOE_LATENT = ("needs Transformer Engine: Megatron-Core 0.16.1 builds the latent projections "
              "with its TELinear")

NO_EFFECT: Dict[str, str] = {
    "--pipeline-model-parallel-comm-backend": NCCL,
    "--moe-extended-tp": UNREAD_BY_CORE,
    "--no-async-tensor-model-parallel-allreduce": GPU_OVERLAP,
    "--no-tp-comm-bulk-wgrad": TP_OVERLAP_OFF,
    "--no-tp-comm-bulk-dgrad": TP_OVERLAP_OFF,
    "--no-tp-comm-overlap-ag": TP_OVERLAP_OFF,
    "--no-tp-comm-overlap-rs": TP_OVERLAP_OFF,
    "--tp-comm-overlap-rs-dgrad": TP_OVERLAP_OFF,
    "--no-tp-comm-split-ag": TP_OVERLAP_OFF,
    "--no-tp-comm-split-rs": TP_OVERLAP_OFF,
    "--cross-entropy-loss-fusion": FUSED_KERNEL,
    "--cross-entropy-fusion-impl": FUSED_KERNEL,
    "--tp-comm-bootstrap-backend": TP_OVERLAP_OFF,
    "--ep-overlap-early-attn-memory-release": GPU_MEMORY,
    "--use-ring-exchange-p2p": GPU_OVERLAP,
    "--defer-embedding-wgrad-compute": GPU_OVERLAP,
    "--wgrad-deferral-limit": GPU_OVERLAP,
    "--overlap-p2p-communication-warmup-flush": GPU_OVERLAP,
    "--cpu-offloading-num-layers": GPU_MEMORY,
    "--apply-residual-connection-post-layernorm": UNREAD_BY_CORE,
    "--qk-clip-alpha": QK_CLIP_OFF,
    "--qk-clip-threshold": QK_CLIP_OFF,
    "--disable-bf16-reduced-precision-matmul": GPU_MATH,
    "--use-fused-weighted-squared-relu": FUSED_KERNEL,
    "--distribute-saved-activations": GPU_MEMORY,
    "--fp8-recipe": FP8_OFF,
    "--fp8-quantizer-factory": FP8_OFF,
    "--fp8-margin": FP8_OFF,
    "--fp8-interval": FP8_OFF,
    "--fp8-amax-history-len": FP8_OFF,
    "--fp8-amax-compute-algo": FP8_OFF,
    "--no-fp8-wgrad": FP8_OFF,
    "--first-last-layers-bf16": FP8_OFF,
    "--num-layers-at-start-in-bf16": FP8_OFF,
    "--num-layers-at-end-in-bf16": FP8_OFF,
    "--fp4-recipe": FP8_OFF,
    "--fp4-quantizer-factory": FP8_OFF,
    "--moe-router-padding-for-quantization": FP8_OFF,
    "--moe-router-padding-for-fp8": FP8_OFF,
    "--moe-flex-dispatcher-backend": FLEX_OFF,
    "--moe-permute-fusion": FUSED_KERNEL,
    "--moe-router-fusion": FUSED_KERNEL,
    "--moe-deepep-num-sms": FLEX_OFF,
    "--moe-hybridep-num-sms": FLEX_OFF,
    "--cuda-graph-warmup-steps": CUDA_GRAPHS_OFF,
    "--no-clone-scatter-output-in-embedding": GPU_MEMORY,
    "--symmetric-ar-type": NCCL,
    "--fine-grained-activation-offloading": GPU_MEMORY,
    "--offload-modules": GPU_MEMORY,
    "--min-offloaded-tensor-size": GPU_MEMORY,
    "--decoder-num-layers": T5_DECODER,
    "--relative-attention-num-buckets": RELATIVE_OFF,
    "--relative-attention-max-distance": RELATIVE_OFF,
    "--rotary-seq-len-interpolation-factor": UNREAD_BY_CORE,
    "--rope-scaling-factor": ROPE_FACTOR,
    "--onnx-safe": EXPORT,
    "--muon-momentum": MUON_OFF,
    "--muon-no-split-qkv": MUON_OFF,
    "--muon-use-nesterov": MUON_OFF,
    "--muon-scale-mode": MUON_OFF,
    "--muon-fp32-matmul-prec": MUON_OFF,
    "--muon-num-ns-steps": MUON_OFF,
    "--muon-tp-mode": MUON_OFF,
    "--muon-extra-scale-factor": MUON_OFF,
    "--profile": PROFILING,
    "--profile-step-start": PROFILING,
    "--profile-step-end": PROFILING,
    "--use-pytorch-profiler": PROFILING,
    "--profile-ranks": PROFILING,
    "--record-memory-history": PROFILING,
    "--memory-snapshot-path": PROFILING,
    "--empty-unused-memory-level": GPU_MEMORY,
    "--train-sync-interval": GPU_OVERLAP,
    "--exit-signal-handler-for-dataloader": UNREAD,
    "--disable-gloo-process-groups": GLOO,
    "--tp-comm-overlap-cfg": TP_OVERLAP_OFF,
    "--no-masked-softmax-fusion": FUSED_KERNEL,
    "--no-bias-gelu-fusion": FUSED_KERNEL,
    "--no-bias-swiglu-fusion": FUSED_KERNEL,
    "--no-bias-dropout-fusion": FUSED_KERNEL,
    "--no-rope-fusion": FUSED_KERNEL,
    "--use-flash-attn": FUSED_KERNEL,
    "--optimizer-cpu-offload": GPU_MEMORY,
    "--optimizer-offload-fraction": GPU_MEMORY,
    "--use-torch-optimizer-for-cpu-offload": GPU_MEMORY,
    "--overlap-cpu-optimizer-d2h-h2d": GPU_MEMORY,
    "--no-pin-cpu-grads": GPU_MEMORY,
    "--no-pin-cpu-params": GPU_MEMORY,
    "--no-persist-layer-norm": FUSED_KERNEL,
    "--no-gradient-accumulation-fusion": FUSED_KERNEL,
    "--use-mcore-models": ALWAYS_MCORE,
    "--high-priority-stream-groups": GPU_OVERLAP,
    "--disable-jit-fuser": FUSED_KERNEL,
    "--async-save": ASYNC_SAVE,
    "--use-persistent-ckpt-worker": ASYNC_SAVE,
    "--non-persistent-local-ckpt-dir": LOCAL_CKPT_OFF,
    "--non-persistent-local-ckpt-algo": LOCAL_CKPT_OFF,
    "--dist-ckpt-save-pre-mcore-014": READ_NOWHERE,
    "--replication-jump": REPLICATION_OFF,
    "--replication-factor": REPLICATION_OFF,
    "--dist-ckpt-format": DEPRECATED_FORMAT,
    "--ckpt-fully-parallel-save": PARALLEL_SAVE_DEFAULT,
    "--no-strict-fsdp-dtensor-load": FSDP_CKPT_OFF,
    "--use-dist-ckpt": ALWAYS_MCORE,
    "--fp16-lm-cross-entropy": UNREAD_BY_CORE,
    "--reuse-grad-buf-for-mxfp8-param-ag": FP8_OFF,
    "--no-overlap-p2p-communication": GPU_OVERLAP,
    "--no-align-grad-reduce": GPU_OVERLAP,
    "--ddp-pad-buckets-for-high-nccl-busbw": NCCL,
    "--overlap-param-gather-with-optimizer-step": GPU_OVERLAP,
    "--no-align-param-gather": GPU_OVERLAP,
    "--no-scatter-gather-tensors-in-pipeline": GPU_OVERLAP,
    "--local-rank": LOCAL_RANK,
    "--use-nccl-ub": NCCL,
    "--disable-symmetric-registration": NCCL,
    "--fsdp-manual-registration": NCCL,
    "--use-sharp": NCCL,
    "--sharp-enabled-group": NCCL,
    "--create-all-gather-group": NCCL,
    "--outer-dp-sharding-strategy": HSDP_OFF,
    "--no-gradient-reduce-div-fusion": FUSED_KERNEL,
    "--fsdp-double-buffer": FSDP_BUFFERS,
    "--suggested-communication-unit-size": FSDP_BUFFERS,
    "--keep-fp8-transpose-cache": FP8_OFF,
    "--enable-full-sharding-in-hsdp": HSDP_OFF,
    "--torch-fsdp2-no-reshard-after-forward": FSDP2_OFF,
    "--nccl-communicator-config-path": NCCL,
    "--dataloader-fast-cache-load": INDEX_SPEED,
    "--dataloader-defer-npy-index-mmap": INDEX_SPEED,
    "--num-dataset-builder-threads": INDEX_SPEED,
    "--decoder-seq-length": DECODER_ONLY,
    "--sample-rate": SAMPLE_RATE,
    "--object-storage-cache-path": OBJECT_STORAGE,
    "--tokenizer-hf-use-fast": HF_FAST,
    "--trust-remote-code": HF_REMOTE_CODE,
    "--log-energy": PROFILING,
    "--log-straggler": TELEMETRY,
    "--straggler-ctrlr-port": TELEMETRY,
    "--straggler-minmax-count": TELEMETRY,
    "--disable-straggler-on-startup": TELEMETRY,
    "--run-workload-inspector-server": TELEMETRY,
    "--cuda-graph-scope": CUDA_GRAPHS_OFF,
    "--enable-experimental": EXPERIMENTAL,
    "--main-grads-dtype": PRECISION_AWARE_OFF,
    "--main-params-dtype": PRECISION_AWARE_OFF,
    "--exp-avg-dtype": PRECISION_AWARE_OFF,
    "--exp-avg-sq-dtype": PRECISION_AWARE_OFF,
    "--no-one-logger": TELEMETRY,
    "--one-logger-project": TELEMETRY,
    "--one-logger-run-name": TELEMETRY,
    "--one-logger-async": TELEMETRY,
    "--app-tag-run-name": TELEMETRY,
    "--app-tag-run-version": TELEMETRY,
    "--disable-msc": STORAGE_CLIENT,
}

REFUSED: Dict[str, str] = {
    "--hierarchical-context-parallel-sizes": HIERARCHICAL_CP,
    "--max-seqlen-per-dp-cp-rank": HYBRID_CP,
    "--hybrid-context-parallel": HYBRID_CP,
    "--tp-comm-overlap": NEEDS_TE,
    "--qk-clip": QK_CLIP,
    "--experimental-attention-variant": NOT_BUILT,
    "--dsa-indexer-n-heads": NOT_BUILT,
    "--dsa-indexer-head-dim": NOT_BUILT,
    "--dsa-indexer-topk": NOT_BUILT,
    "--dsa-indexer-loss-coeff": NOT_BUILT,
    "--dsa-indexer-use-sparse-loss": NOT_BUILT,
    "--linear-conv-kernel-dim": NOT_BUILT,
    "--linear-key-head-dim": NOT_BUILT,
    "--linear-value-head-dim": NOT_BUILT,
    "--linear-num-key-heads": NOT_BUILT,
    "--linear-num-value-heads": NOT_BUILT,
    "--init-model-with-meta-device": META_INIT,
    "--fp8-format": NEEDS_GPU_FP8,
    "--use-kitchen-attention": NOT_BUILT,
    "--kitchen-attention-backend": NOT_BUILT,
    "--fp4-format": NEEDS_GPU_FP8,
    "--fp4-param-gather": NEEDS_GPU_FP8,
    "--moe-enable-routing-replay": NOT_BUILT,
    "--moe-use-legacy-grouped-gemm": NEEDS_DEEPEP,
    "--moe-enable-deepep": NEEDS_DEEPEP,
    "--moe-latent-size": MOE_LATENT,
    "--enable-cuda-graph": CUDA_GRAPHS,
    "--external-cuda-graph": CUDA_GRAPHS,
    "--cuda-graph-impl": CUDA_GRAPHS,
    "--config-logger-dir": NOT_BUILT,
    "--flash-decode": INFERENCE,
    "--batch-invariant-mode": INFERENCE,
    "--use-te-activation-func": NEEDS_TE,
    "--inference-fuse-tp-communication": INFERENCE,
    "--mrope-section": NOT_BUILT,
    "--is-hybrid-model": MAMBA,
    "--mamba-state-dim": MAMBA,
    "--mamba-head-dim": MAMBA,
    "--mamba-num-groups": MAMBA,
    "--mamba-num-heads": MAMBA,
    "--disable-mamba-mem-eff-path": MAMBA,
    "--mlp-chunks-for-prefill": INFERENCE,
    "--batch-size": RENAMED,
    "--checkpoint-activations": RENAMED,
    "--dump-param-to-param-group-map": NOT_BUILT,
    "--use-legacy-models": LEGACY_MODELS,
    "--perform-rl-step": NOT_PRETRAINING,
    "--rl-prompts-per-eval": NOT_PRETRAINING,
    "--grpo-prompts-per-step": NOT_PRETRAINING,
    "--grpo-group-size": NOT_PRETRAINING,
    "--grpo-iterations": NOT_PRETRAINING,
    "--grpo-clamp-eps-lower": NOT_PRETRAINING,
    "--grpo-clamp-eps-upper": NOT_PRETRAINING,
    "--grpo-kl-beta": NOT_PRETRAINING,
    "--grpo-entropy-term-weight": NOT_PRETRAINING,
    "--grpo-filter-groups-with-same-reward": NOT_PRETRAINING,
    "--langrl-inference-server-type": NOT_PRETRAINING,
    "--langrl-inference-server-conversation-template": NOT_PRETRAINING,
    "--langrl-external-server": NOT_PRETRAINING,
    "--langrl-env-config": NOT_PRETRAINING,
    "--rl-default-temperature": NOT_PRETRAINING,
    "--rl-default-top-p": NOT_PRETRAINING,
    "--rl-default-top-k": NOT_PRETRAINING,
    "--rl-offload-optimizer-during-inference": NOT_PRETRAINING,
    "--rl-offload-kv-cache-during-training": NOT_PRETRAINING,
    "--rl-remove-kv-cache-during-training": NOT_PRETRAINING,
    "--rl-reset-cuda-graphs": NOT_PRETRAINING,
    "--rl-partial-rollouts": NOT_PRETRAINING,
    "--rl-inference-logprobs-is-correction": NOT_PRETRAINING,
    "--rl-importance-sampling-truncation-coef": NOT_PRETRAINING,
    "--rl-use-sequence-packing": NOT_PRETRAINING,
    "--rl-sequence-packing-max-sequences-per-bin": NOT_PRETRAINING,
    "--rl-sequence-packing-algo": NOT_PRETRAINING,
    "--rl-training-cuda-graphs": NOT_PRETRAINING,
    "--rl-inference-tensor-model-parallel-size": NOT_PRETRAINING,
    "--rl-inference-pipeline-model-parallel-size": NOT_PRETRAINING,
    "--rl-inference-expert-model-parallel-size": NOT_PRETRAINING,
    "--rl-inference-expert-tensor-model-parallel-size": NOT_PRETRAINING,
    "--rl-inference-model-unified-memory-level": NOT_PRETRAINING,
    "--rl-offload-inference-model-weights-when-idle": NOT_PRETRAINING,
    "--refit-method": NOT_PRETRAINING,
    "--rl-verify-model-weights-swap": NOT_PRETRAINING,
    "--rl-parallel-generation-tasks": NOT_PRETRAINING,
    "--rl-skip-bos-token": NOT_PRETRAINING,
    "--te-rng-tracker": NEEDS_TE,
    "--inference-rng-tracker": INFERENCE,
    "--warmup": RENAMED,
    "--save-wgrads-interval": GRAD_FILES,
    "--save-dgrads-interval": GRAD_FILES,
    "--load-main-params-from-ckpt": MAIN_PARAMS_FROM_CKPT,
    "--replication": REPLICATION,
    "--ckpt-convert-format": NOT_BUILT,
    "--ckpt-convert-save": NOT_BUILT,
    "--ckpt-convert-update-legacy-dist-opt-format": NOT_BUILT,
    "--model-parallel-size": RENAMED,
    "--lazy-mpu-init": NOT_BUILT,
    "--use-torch-fsdp2": FSDP2,
    "--fake-process-group": NOT_BUILT,
    "--full-validation": FULL_VALIDATION,
    "--multiple-validation-sets": VALIDATION_SETS,
    "--fim-data": FIM,
    "--fim-rate": FIM,
    "--fim-spm-rate": FIM,
    "--fim-split-sample": FIM,
    "--fim-fragment-rate": FIM,
    "--fim-no-prefix": FIM,
    "--fim-prefix-token": FIM,
    "--fim-middle-token": FIM,
    "--fim-suffix-token": FIM,
    "--fim-pad-token": FIM,
    "--fim-eod-token": FIM,
    "--tokenizer-metadata": TOKENIZER_METADATA,
    "--legacy-tokenizer": LEGACY_TOKENIZER,
    "--adlr-autoresume": AUTORESUME,
    "--adlr-autoresume-interval": AUTORESUME,
    "--ict-head-size": NOT_PRETRAINING,
    "--biencoder-projection-dim": NOT_PRETRAINING,
    "--biencoder-shared-query-context-model": NOT_PRETRAINING,
    "--ict-load": NOT_PRETRAINING,
    "--bert-load": NOT_PRETRAINING,
    "--titles-data-path": NOT_PRETRAINING,
    "--query-in-block-prob": NOT_PRETRAINING,
    "--use-one-sent-docs": NOT_PRETRAINING,
    "--evidence-data-path": NOT_PRETRAINING,
    "--retriever-report-topk-accuracies": NOT_PRETRAINING,
    "--retriever-score-scaling": NOT_PRETRAINING,
    "--block-data-path": NOT_PRETRAINING,
    "--embedding-path": NOT_PRETRAINING,
    "--indexer-batch-size": NOT_PRETRAINING,
    "--indexer-log-interval": NOT_PRETRAINING,
    "--num-classes": NOT_PRETRAINING,
    "--img-h": NOT_PRETRAINING,
    "--img-w": NOT_PRETRAINING,
    "--num-channels": NOT_PRETRAINING,
    "--patch-dim": NOT_PRETRAINING,
    "--classes-fraction": NOT_PRETRAINING,
    "--data-per-class-fraction": NOT_PRETRAINING,
    "--no-data-sharding": NOT_PRETRAINING,
    "--head-lr-mult": NOT_PRETRAINING,
    "--vision-pretraining": NOT_PRETRAINING,
    "--vision-pretraining-type": NOT_PRETRAINING,
    "--vision-backbone-type": NOT_PRETRAINING,
    "--swin-backbone-type": NOT_PRETRAINING,
    "--mask-type": NOT_PRETRAINING,
    "--mask-factor": NOT_PRETRAINING,
    "--iter-per-epoch": NOT_PRETRAINING,
    "--dino-local-img-size": NOT_PRETRAINING,
    "--dino-local-crops-number": NOT_PRETRAINING,
    "--dino-head-hidden-size": NOT_PRETRAINING,
    "--dino-bottleneck-size": NOT_PRETRAINING,
    "--dino-freeze-last-layer": NOT_PRETRAINING,
    "--dino-norm-last-layer": NOT_PRETRAINING,
    "--dino-warmup-teacher-temp": NOT_PRETRAINING,
    "--dino-teacher-temp": NOT_PRETRAINING,
    "--dino-warmup-teacher-temp-epochs": NOT_PRETRAINING,
    "--moe-pad-experts-for-cuda-graph-inference": INFERENCE,
    "--cache-mla-latents": INFERENCE,
    "--linear-attention-freq": NOT_BUILT,
    "--heterogeneous-layers-config-path": NOT_BUILT,
    "--heterogeneous-layers-config-encoded-json": NOT_BUILT,
    "--log-max-attention-logit": MAX_ATTENTION_LOGIT,
    "--inference-batch-times-seqlen-threshold": INFERENCE,
    "--max-tokens-to-oom": INFERENCE,
    "--output-bert-embeddings": INFERENCE,
    "--bert-embedder-type": INFERENCE,
    "--use-legacy-static-engine": INFERENCE,
    "--inference-max-requests": INFERENCE,
    "--inference-max-seq-length": INFERENCE,
    "--inference-max-batch-size": INFERENCE,
    "--inference-dynamic-batching": INFERENCE,
    "--inference-dynamic-batching-buffer-size-gb": INFERENCE,
    "--inference-dynamic-batching-paused-buffer-size-gb": INFERENCE,
    "--inference-dynamic-batching-block-size": INFERENCE,
    "--inference-dynamic-batching-max-requests": INFERENCE,
    "--inference-dynamic-batching-max-tokens": INFERENCE,
    "--inference-dynamic-batching-num-cuda-graphs": INFERENCE,
    "--inference-dynamic-batching-track-paused-request-events": INFERENCE,
    "--decode-only-cuda-graphs": INFERENCE,
    "--inference-dynamic-batching-unified-memory-level": INFERENCE,
    "--nccl-all-reduce-for-prefill": INFERENCE,
    "--enable-chunked-prefill": INFERENCE,
    "--disable-chunked-prefill": INFERENCE,
    "--inference-dynamic-batching-cuda-graph-max-tokens": INFERENCE,
    "--inference-dynamic-batching-cuda-graph-mixed-prefill-count": INFERENCE,
    "--inference-logging-step-interval": INFERENCE,
    "--inference-wandb-logging": INFERENCE,
    "--inference-coordinator-port": INFERENCE,
    "--fp8-param-gather": NEEDS_GPU_FP8,
    "--te-precision-config-file": NEEDS_TE,
    "--spec": NOT_BUILT,
    "--hybrid-attention-ratio": MAMBA,
    "--hybrid-mlp-ratio": MAMBA,
    "--hybrid-override-pattern": MAMBA,
    "--yaml-cfg": NOT_BUILT,
    "--use-precision-aware-optimizer": NEEDS_TE,
    "--inprocess-restart": INPROCESS,
    "--inprocess-max-iterations": INPROCESS,
    "--inprocess-monitor-thread-interval": INPROCESS,
    "--inprocess-monitor-process-interval": INPROCESS,
    "--inprocess-progress-watchdog-interval": INPROCESS,
    "--inprocess-heartbeat-interval": INPROCESS,
    "--inprocess-soft-timeout": INPROCESS,
    "--inprocess-hard-timeout": INPROCESS,
    "--inprocess-heartbeat-timeout": INPROCESS,
    "--inprocess-barrier-timeout": INPROCESS,
    "--inprocess-completion-timeout": INPROCESS,
    "--inprocess-last-call-wait": INPROCESS,
    "--inprocess-termination-grace-time": INPROCESS,
    "--inprocess-granularity": INPROCESS,
    "--inprocess-active-world-size": INPROCESS,
    "--inprocess-empty-cuda-cache": INPROCESS,
    "--enable-ft-package": FT_PACKAGE,
    "--calc-ft-timeouts": FT_PACKAGE,
    "--ft-num-warmup-iters": FT_PACKAGE,
    "--sft": NOT_PRETRAINING,
    "--sft-tokenizer-prompt-format": NOT_PRETRAINING,
}
