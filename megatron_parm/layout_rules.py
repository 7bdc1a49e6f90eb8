"""What a model needs of a parallel layout under Megatron-Core 0.16.1, in one place.

Torch-free, at the bottom of the package: training's flag checks (training/arguments.py) and
the layout planner (perf_model/transformer.py, perf_model/planner.py) ask the same questions
here and get the same one-line answers, each naming the flags to change. A dispatcher's own
rules are its entry in the schedule catalog (schedules.py).
"""

from __future__ import annotations

from typing import Optional

from megatron_parm.wording import plural

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GROUPED_GEMM_ALIGN_BYTES = 16  # PyTorch's grouped_mm: every operand row on a 16-byte boundary


def shape_problem(hidden_size: int, num_attention_heads: int, seq_length: int,
                  max_position_embeddings: int, num_experts: Optional[int], topk: int
                  ) -> Optional[str]:
    """Why the model's own sizes do not fit together, whatever the layout, or None."""
    if seq_length > max_position_embeddings:
        return (f"--seq-length ({seq_length}) must not exceed --max-position-embeddings "
                f"({max_position_embeddings})")
    if hidden_size % num_attention_heads != 0:
        return (f"--hidden-size ({hidden_size}) must be divisible by --num-attention-heads "
                f"({num_attention_heads})")
    return routing_problem(num_experts, topk)


def routing_problem(num_experts: Optional[int], topk: int) -> Optional[str]:
    """Why a token cannot pick topk of num_experts experts, or None (dense: num_experts None)."""
    if num_experts is not None and not 1 <= topk <= num_experts:
        return f"--moe-router-topk ({topk}) must be in [1, --num-experts ({num_experts})]"
    return None


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default FFN width: 4 x hidden, or with SwiGLU 8/3 x hidden rounded down
    to a multiple of 64 (the same parameters as the GeLU MLP)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def pre_softmax_routing(moe_router_pre_softmax: bool, topk: int) -> bool:
    """Whether the router takes the softmax over all experts before its top-k: as
    --moe-router-pre-softmax says, and always at top-1 (Megatron-Core refuses a softmax over
    one expert)."""
    return moe_router_pre_softmax or topk == 1


def moe_layer_pattern(moe_layer_freq, num_layers: int) -> list:
    """1 (MoE) or 0 (dense) per layer, as Megatron-Core reads --moe-layer-freq (an int N: every
    N-th layer from the first; a list: as given)."""
    if isinstance(moe_layer_freq, list):
        return list(moe_layer_freq)
    return [1 if layer % moe_layer_freq == 0 else 0 for layer in range(num_layers)]


def architecture_problem(*, model_type: str, num_layers: int, num_attention_heads: int,
                         tp: int, num_experts: Optional[int], topk: int, moe_layer_freq=1,
                         group_query_attention: bool = False, num_query_groups: int = 1,
                         position_embedding_type: str = "learned_absolute",
                         qk_layernorm: bool = False, multi_latent_attention: bool = False,
                         shared_expert_size: Optional[int] = None, shared_expert_gate=False,
                         shared_expert_overlap: bool = False, add_bias_linear: bool = True,
                         sequence_parallel: bool = False, score_function: str = "softmax",
                         expert_bias: bool = False, num_groups: Optional[int] = None,
                         group_topk: Optional[int] = None) -> Optional[str]:
    """Why the architecture flags (attention, layers, shared experts, router) do not go
    together under Megatron-Core 0.16.1, or None: what its TransformerConfig, specs and
    router refuse, said with the flags."""
    if multi_latent_attention and model_type == "bert":
        return "--multi-latent-attention applies to GPT models (BERT keeps Megatron-Core's BERT layer)"
    if multi_latent_attention and group_query_attention:
        return ("--multi-latent-attention and --group-query-attention exclude each other "
                "(Megatron-LM refuses the two together)")
    if model_type == "bert":
        for given, flag in ((position_embedding_type != "learned_absolute",
                             "--position-embedding-type"), (moe_layer_freq != 1, "--moe-layer-freq"),
                            (qk_layernorm, "--qk-layernorm")):
            if given:
                return f"{flag} applies to GPT models (BERT keeps Megatron-Core's BERT layer)"
    if group_query_attention:
        if num_attention_heads % num_query_groups != 0:
            return (f"--num-attention-heads ({num_attention_heads}) must be divisible by "
                    f"--num-query-groups ({num_query_groups})")
        if num_query_groups % tp != 0 and tp % num_query_groups != 0:
            return (f"--num-query-groups ({num_query_groups}) must be a multiple or a divisor of "
                    f"--tensor-model-parallel-size ({tp})")
    pattern = moe_layer_pattern(moe_layer_freq, num_layers)
    if len(pattern) != num_layers:
        return (f"--moe-layer-freq gives {plural(len(pattern), 'layer')}, the model has "
                f"--num-layers {num_layers}")
    if num_experts is None:
        moe_only = ((shared_expert_size is not None, "--moe-shared-expert-intermediate-size"),
                    (expert_bias, "--moe-router-enable-expert-bias"),
                    (num_groups is not None, "--moe-router-num-groups"))
        for given, flag in moe_only:
            if given:
                return f"{flag} needs --num-experts (the model is dense)"
        return None
    if not any(pattern):
        return "--moe-layer-freq makes every layer dense: give at least one 1 (an MoE layer)"
    if shared_expert_size is None and (shared_expert_gate or shared_expert_overlap):
        flag = "--moe-shared-expert-gate" if shared_expert_gate else "--moe-shared-expert-overlap"
        return f"{flag} needs --moe-shared-expert-intermediate-size (the shared experts)"
    if shared_expert_size is not None and add_bias_linear:
        return ("--moe-shared-expert-intermediate-size needs --disable-bias-linear (Megatron-Core "
                "0.16.1's shared experts have no biases)")
    if shared_expert_overlap:
        problem = shared_expert_overlap_problem(tp, sequence_parallel)
        if problem:
            return problem
    if expert_bias and score_function != "sigmoid":
        return ("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                "(Megatron-Core 0.16.1's aux-loss-free balancing)")
    return router_groups_problem(num_experts, topk, num_groups, group_topk)


def mtp_problem(mtp_num_layers: Optional[int], *, model_type: str, position_embedding_type: str,
                recompute_method: Optional[str], recompute_num_layers: Optional[int],
                overlap_moe_comm: bool = False, pp: int = 1) -> Optional[str]:
    """Why --mtp-num-layers cannot run with the other flags (Megatron-LM's and Megatron-Core
    0.16.1's rules), or None."""
    if not mtp_num_layers:
        return None
    if model_type != "gpt":
        return (f"{MTP_FLAG}: multi-token prediction is a GPT model's (Megatron-Core 0.16.1 builds "
                f"it in GPTModel), not BERT's")
    if position_embedding_type not in ("rope", "none"):
        return (f"{MTP_FLAG} needs --position-embedding-type rope or none (Megatron-LM refuses "
                f"{position_embedding_type})")
    if recompute_method == "uniform" and recompute_num_layers != 1:
        return (f"{MTP_FLAG} with --recompute-method uniform needs --recompute-num-layers 1 "
                f"(Megatron-Core 0.16.1 recomputes an MTP layer only so)")
    if overlap_moe_comm and pp == 1:
        return (f"{MTP_FLAG} with --overlap-moe-expert-parallel-comm needs "
                f"--pipeline-model-parallel-size > 1 (Megatron-Core 0.16.1 runs the MTP layer's "
                f"nodes in the interleaved pipeline schedule only): add pipeline stages, or drop "
                f"one of the two")
    return None


def mla_problem(tp: int, q_lora_rank: Optional[int], kv_lora_rank: int,
                qk_pos_emb_head_dim: int) -> Optional[str]:
    """Why multi-latent attention's down projections do not split over tp ranks, or None:
    Megatron-Core's local spec makes them column-parallel (each rank computes a share of the
    latent, then gathers it)."""
    for flags, width in (("--q-lora-rank", q_lora_rank),
                         ("--kv-lora-rank + --qk-pos-emb-head-dim",
                          kv_lora_rank + qk_pos_emb_head_dim)):
        if width is not None and width % tp != 0:
            return (f"{flags} ({width}) must be divisible by --tensor-model-parallel-size ({tp}) "
                    f"(multi-latent attention's down projections split over it)")
    return None


def shared_expert_overlap_problem(tp: int, sequence_parallel: bool) -> Optional[str]:
    """Why the shared experts cannot overlap the dispatch at this TP, or None: their overlapped
    steps take sequence-parallel input, as Megatron-Core's MoE layer has it at TP > 1."""
    if tp > 1 and not sequence_parallel:
        return ("--moe-shared-expert-overlap with --tensor-model-parallel-size > 1 needs "
                "--sequence-parallel (as Megatron-Core's MoE layer)")
    return None


def router_groups_problem(num_experts: int, topk: int, num_groups: Optional[int],
                          group_topk: Optional[int]) -> Optional[str]:
    """Why group-limited routing cannot pick topk experts from group_topk of num_groups groups
    of the experts, or None."""
    if (num_groups is None) != (group_topk is None):
        return "--moe-router-num-groups and --moe-router-group-topk go together: give both"
    if num_groups is None:
        return None
    if num_experts % num_groups != 0:
        return (f"--moe-router-num-groups ({num_groups}) must divide --num-experts "
                f"({num_experts}) into equal groups")
    if group_topk > num_groups:
        return (f"--moe-router-group-topk ({group_topk}) must be at most "
                f"--moe-router-num-groups ({num_groups})")
    per_group = num_experts // num_groups
    if not group_topk <= topk <= group_topk * per_group:
        return (f"--moe-router-topk ({topk}) must be at least --moe-router-group-topk "
                f"({group_topk}) (each group is scored by its top topk / group-topk experts) "
                f"and fit in the chosen groups ({group_topk} x {per_group} experts)")
    return None


def capacity_problem(capacity_factor: Optional[float], pad_to_capacity: bool) -> Optional[str]:
    """Why the capacity flags do not go together, or None."""
    if pad_to_capacity and capacity_factor is None:
        return "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"
    return None


def precision_problem(bf16: bool, fp16: bool) -> Optional[str]:
    """Why the precision flags exclude each other, or None."""
    return "--bf16 and --fp16 are mutually exclusive: pick one" if bf16 and fp16 else None


def layout_problem(world_size: int, tp: int, ep: int, etp: int,
                   num_experts: Optional[int] = None, pp: int = 1, cp: int = 1) -> Optional[str]:
    """Why (tp, ep, etp, pp, cp) cannot lay out world_size ranks (or split num_experts), or None.

    Megatron puts the pipeline stages outermost: each stage has world_size / pp ranks, laid
    out by (tp, ep, etp) as a whole world would be. Its attention ranks are tp x cp x dp
    (world = tp x cp x pp x dp), and its expert ranks etp x ep x expert-dp over the same
    tp x cp x dp ranks of a stage, so etp x ep divides tp x cp x dp."""
    for flag, value in (("--tensor-model-parallel-size", tp), ("--expert-model-parallel-size", ep),
                        ("--expert-tensor-parallel-size", etp), (CP_FLAG, cp)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    problem = size_problem("--pipeline-model-parallel-size", pp, world_size)
    if problem:
        return problem
    stage = world_size // pp
    where = (f"the world size ({world_size})" if pp == 1 else
             f"the ranks of a pipeline stage ({world_size} / --pipeline-model-parallel-size "
             f"{pp} = {stage})")
    if stage % tp != 0:
        return f"--tensor-model-parallel-size ({tp}) must divide {where}"
    if stage % (tp * cp) != 0:
        return (f"--tensor-model-parallel-size x {CP_FLAG} ({tp} x {cp}) must divide {where}")
    if stage % etp != 0:
        return f"--expert-tensor-parallel-size ({etp}) must divide {where}"
    if stage % (etp * ep) != 0:
        return (f"--expert-tensor-parallel-size x --expert-model-parallel-size ({etp} x {ep}) "
                f"must divide {where}")
    return experts_problem(num_experts, ep)


# Megatron-Core's rank orders, by Megatron-LM's --use-tp-pp-dp-mapping: the default puts the
# pipeline stages outermost (a stage is consecutive ranks), the other puts data parallelism
# outermost (a pipeline group strides by tp x cp). TP, CP and the ESP x EP blocks are the same
# consecutive ranks in both, so the dispatchers' groups, parm_hier's node split and the
# per-layer cost plans do not depend on the order; the data-parallel and pipeline groups do.
RANK_ORDERS = {False: "tp-cp-ep-dp-pp", True: "tp-cp-ep-pp-dp"}


def rank_order_problem(tp_pp_dp: bool, tp: int, cp: int, ep: int, etp: int,
                       pp: int) -> Optional[str]:
    """Why --use-tp-pp-dp-mapping cannot order this layout, or None: with pipelining,
    Megatron-Core 0.16.1 needs the expert layers' data-parallel size equal to attention's
    where the stages are not outermost."""
    if tp_pp_dp and pp > 1 and ep * etp != tp * cp:
        return (f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp}: "
                f"--expert-model-parallel-size x --expert-tensor-parallel-size ({ep} x {etp}) "
                f"must equal --tensor-model-parallel-size x {CP_FLAG} ({tp} x {cp}), so that "
                f"the expert layers' data-parallel size is attention's (Megatron-Core's rule "
                f"where the pipeline stages are not the outermost ranks)")
    return None


CP_FLAG = "--context-parallel-size"
CP_COMM_FLAG = "--cp-comm-type"
# The values of --cp-comm-type that Megatron-Core's attention knows (Transformer Engine's), and
# those megatron_parm.attention runs without Transformer Engine.
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
CP_COMM_LOCAL = ("all_gather", "a2a")


def context_parallel_problem(cp: int, *, model_type: str, seq_length: int, tp: int,
                             sequence_parallel: bool, moe: bool, comm_types, num_layers: int,
                             transformer_impl: str, num_attention_heads: int,
                             num_query_groups: Optional[int]) -> Optional[str]:
    """Why the model cannot split its sequences over cp context-parallel ranks, or None.

    Megatron-LM's rules (a sequence in 2 x cp chunks), the local attention's
    (megatron_parm.attention: all_gather and a2a; a2a splits the heads of a TP rank over the
    CP ranks), and what is not built here (BERT)."""
    if cp == 1:
        return None
    if model_type != "gpt":
        return (f"{CP_FLAG} {cp} with BERT is not built here (its bidirectional attention "
                f"and padding masks): GPT models take it")
    if seq_length % (2 * cp):
        return (f"--seq-length ({seq_length}) must be a multiple of 2 x {CP_FLAG} ({2 * cp}): "
                f"each sequence splits into 2 x {cp} chunks")
    if (sequence_parallel or moe) and (seq_length // cp) % tp:
        return (f"--seq-length / {CP_FLAG} ({seq_length} / {cp}) must be divisible by "
                f"--tensor-model-parallel-size ({tp}): each rank's part of a sequence splits "
                f"over TP")
    if len(comm_types) not in (1, num_layers):
        return (f"{CP_COMM_FLAG}: one value for every layer or one per layer ({num_layers}), "
                f"got {len(comm_types)}")
    if len(set(comm_types)) > 1:
        return (f"{CP_COMM_FLAG} {' '.join(comm_types)}: a type per layer fails in Megatron-Core "
                f"0.16.1 (its layer l takes the list's entry l, numbering from 1: the last layer "
                f"has none): give one value")
    if transformer_impl != "transformer_engine":
        refused = [value for value in comm_types if value not in CP_COMM_LOCAL]
        if refused:
            return (f"{CP_COMM_FLAG} {refused[0]}: only {' and '.join(CP_COMM_LOCAL)} run "
                    f"without Transformer Engine (--transformer-impl local): give "
                    f"{CP_COMM_FLAG} all_gather")
    if "a2a" in comm_types:
        groups = num_query_groups or num_attention_heads
        for what, count in (("--num-attention-heads", num_attention_heads),
                            ("--num-query-groups", groups)):
            if count % tp or (count // tp) % cp:
                return (f"{CP_COMM_FLAG} a2a splits the heads of a TP rank over the CP ranks: "
                        f"{what} / --tensor-model-parallel-size ({count} / {tp}) must be "
                        f"divisible by {CP_FLAG} ({cp})")
    return None


def size_problem(flag: str, value: int, world_size: int) -> Optional[str]:
    """Why one parallel size (the flag's value) cannot split world_size ranks, or None."""
    if value < 1:
        return f"{flag} must be >= 1, got {value}"
    if world_size % value != 0:
        return f"{flag} ({value}) must divide the world size ({world_size})"
    return None


def experts_problem(num_experts: Optional[int], ep: int) -> Optional[str]:
    """Why the experts do not split evenly over the EP ranks, or None."""
    if num_experts is not None and num_experts % ep != 0:
        return (f"--num-experts ({num_experts}) must be divisible by "
                f"--expert-model-parallel-size ({ep})")
    return None


def sequence_problem(seq_length: int, tp: int, sequence_parallel: bool = True) -> Optional[str]:
    """Why the sequence does not split into TP shards, or None. Sequence parallelism splits the
    layer inputs; and every MoE layer routes S / t rows of each sequence per rank, with or
    without it (perf_model.shape.tokens_per_rank)."""
    if seq_length % tp == 0:
        return None
    return (f"--seq-length ({seq_length}) must be divisible by --tensor-model-parallel-size "
            f"({tp})" + (" with --sequence-parallel" if sequence_parallel else
                         " (each MoE layer routes seq-length / tp rows per rank)"))


def model_problem(tp: int, ep: int, etp: int, *, num_attention_heads: int, seq_length: int,
                  sequence_parallel: bool, num_experts: Optional[int],
                  moe_ffn_hidden_size: Optional[int], add_bias_linear: bool) -> Optional[str]:
    """Why the model cannot be split as (tp, ep, etp), or None.

    Attention heads and (with sequence parallelism) the sequence are split over TP, each
    expert's FFN over ETP (the experts over EP: layout_problem); Megatron-Core 0.16.1 has
    expert biases only at ETP 1.
    """
    if num_attention_heads % tp != 0:
        return (f"--num-attention-heads ({num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
    if sequence_parallel or num_experts is not None:
        problem = sequence_problem(seq_length, tp, sequence_parallel)
        if problem:
            return problem
    if num_experts is None:
        return (f"--expert-model-parallel-size {ep} needs --num-experts (without it the model "
                f"is dense)") if ep > 1 else None
    problem = expert_split_problem(moe_ffn_hidden_size, etp)
    if problem:
        return problem
    if add_bias_linear and etp != 1:
        return (f"--num-experts with linear biases needs --expert-tensor-parallel-size 1 "
                f"(got {etp}): Megatron-Core 0.16.1 supports expert biases only without expert "
                f"tensor parallelism; or give --disable-bias-linear")
    return None


def recompute_problem(granularity: Optional[str], method: Optional[str],
                      num_layers: Optional[int], modules, *, layers_per_stage: int,
                      grouped_gemm: bool, shared_experts: bool = False,
                      shared_expert_overlap: bool = False,
                      multi_latent_attention: bool = False) -> Optional[str]:
    """Why the activation-recompute flags cannot go together (Megatron-LM's and Megatron-Core
    0.16.1's rules, and what this project's models have), or None."""
    if granularity is None:
        given = [flag for flag, value in (("--recompute-method", method),
                                          ("--recompute-num-layers", num_layers),
                                          ("--recompute-modules", modules)) if value]
        return f"{given[0]} needs --recompute-granularity" if given else None
    if granularity == "full":
        if modules:
            return ("--recompute-modules applies to --recompute-granularity selective "
                    "(full recomputes whole layers)")
        if method is None or num_layers is None:
            return ("--recompute-granularity full needs --recompute-method (uniform or block) "
                    "and --recompute-num-layers")
        if num_layers > layers_per_stage:
            return (f"--recompute-num-layers ({num_layers}) must be at most the layers of a "
                    f"pipeline stage ({layers_per_stage})")
        return None
    if method is not None or num_layers is not None:
        return ("--recompute-method and --recompute-num-layers apply to --recompute-granularity "
                "full (selective recomputes the modules of --recompute-modules)")
    if "moe_act" in (modules or ()) and not grouped_gemm:
        return "--recompute-modules moe_act needs --moe-grouped-gemm (Megatron-Core 0.16.1)"
    if "mla_up_proj" in (modules or ()) and not multi_latent_attention:
        return "--recompute-modules mla_up_proj needs --multi-latent-attention"
    if "shared_experts" in (modules or ()) and not shared_experts:
        return ("--recompute-modules shared_experts needs shared experts "
                "(--moe-shared-expert-intermediate-size)")
    return shared_expert_recompute_problem(modules, shared_expert_overlap)


def shared_expert_recompute_problem(modules, shared_expert_overlap: bool) -> Optional[str]:
    """Why the shared experts cannot be both recomputed and overlapped, or None."""
    if "shared_experts" in (modules or ()) and shared_expert_overlap:
        return ("--recompute-modules shared_experts cannot go with --moe-shared-expert-overlap "
                "(Megatron-Core 0.16.1 refuses the two together)")
    return None


OVERLAP_FLAG = "--overlap-moe-expert-parallel-comm"


def moe_overlap_problem(overlap: bool, delay_wgrad: bool, *, dispatcher: str, ep: int, pp: int,
                        vpp: Optional[int], half_precision: bool,
                        recompute_granularity: Optional[str], recompute_modules,
                        shared_expert_overlap: bool) -> Optional[str]:
    """Why Megatron-Core 0.16.1's combined 1F1B schedule (--overlap-moe-expert-parallel-comm,
    --delay-wgrad-compute) cannot run with the other flags, naming the one to change, or
    None. Its own rules (TransformerConfig's), and one of its nodes: they call the MoE layer's
    steps one by one, so `--recompute-modules moe` (MoELayer.forward's checkpoint) would be
    silently dropped."""
    if delay_wgrad and not overlap:
        return f"--delay-wgrad-compute needs {OVERLAP_FLAG} (Megatron-Core 0.16.1): add it"
    if not overlap:
        return None
    if dispatcher in ("allgather",):
        return (f"{OVERLAP_FLAG} runs with --moe-token-dispatcher-type alltoall or one of "
                f"Parm's (Megatron-Core 0.16.1 refuses {dispatcher}): pick another dispatcher")
    if ep == 1:
        return (f"{OVERLAP_FLAG} needs expert parallelism (--expert-model-parallel-size > 1): "
                f"without it there is no all-to-all to hide; drop the flag")
    if not half_precision:
        return (f"{OVERLAP_FLAG} needs --bf16 or --fp16 (Megatron-Core 0.16.1 runs the combined "
                f"1F1B schedule in half precision only): add one")
    if pp > 1 and vpp is None:
        return (f"{OVERLAP_FLAG} with --pipeline-model-parallel-size {pp} needs virtual "
                f"pipeline stages (Megatron-Core 0.16.1 interleaves only those): add "
                f"--num-layers-per-virtual-pipeline-stage")
    if recompute_granularity == "full":
        return (f"{OVERLAP_FLAG} cannot run with --recompute-granularity full (Megatron-Core "
                f"0.16.1): use --recompute-granularity selective, or drop {OVERLAP_FLAG}")
    if "moe" in (recompute_modules or ()):
        return (f"{OVERLAP_FLAG} cannot recompute the MoE layer (the combined 1F1B schedule's "
                f"nodes run its steps one by one, without MoELayer.forward's checkpoint): drop "
                f"moe from --recompute-modules (moe_act recomputes the experts' activation)")
    if shared_expert_overlap:
        return (f"--moe-shared-expert-overlap and {OVERLAP_FLAG} exclude each other "
                f"(Megatron-Core 0.16.1): drop --moe-shared-expert-overlap (the combined "
                f"schedule overlaps the other micro-batch's work instead)")
    return None


def ddp_problem(*, overlap_param_gather: bool, overlap_grad_reduce: bool,
                use_distributed_optimizer: bool, average_in_collective: bool, cuda: bool,
                num_buckets: Optional[int] = None, bucket_size: Optional[int] = None,
                reduce_scatter_with_fp32_accumulation: bool = False) -> Optional[str]:
    """Why Megatron-LM's data-parallel flags cannot go together (its rules), or run on this
    machine with Megatron-Core 0.16.1 (cuda: a GPU is usable), or None."""
    if overlap_param_gather and not use_distributed_optimizer:
        return ("--overlap-param-gather needs --use-distributed-optimizer (it overlaps the "
                "distributed optimizer's parameter all-gather): add it or drop "
                "--overlap-param-gather")
    if overlap_param_gather and not overlap_grad_reduce:
        return ("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM): add it "
                "or drop --overlap-param-gather")
    if num_buckets is not None and bucket_size is not None:
        return ("--ddp-num-buckets and --ddp-bucket-size both size the gradient buckets: give "
                "one of them")
    if reduce_scatter_with_fp32_accumulation and not use_distributed_optimizer:
        return ("--ddp-reduce-scatter-with-fp32-accumulation needs --use-distributed-optimizer "
                "(it replaces its gradients' reduce-scatter)")
    if average_in_collective and not cuda:
        return ("--ddp-average-in-collective needs NCCL: gloo (this machine has no GPU) has no "
                "ReduceOp.AVG; drop the flag (the gradients are then scaled by 1/DP before a "
                "summing collective, the same average)")
    return None


def expert_split_problem(moe_ffn_hidden_size: Optional[int], etp: int) -> Optional[str]:
    """Why each expert's FFN does not split over the ETP ranks, or None."""
    if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % etp != 0:
        return (f"--moe-ffn-hidden-size ({moe_ffn_hidden_size}) must be divisible by "
                f"--expert-tensor-parallel-size ({etp})")
    return None


def batch_problem(global_batch_size: int, micro_batch_size: int, data_parallel_size: int
                  ) -> Optional[str]:
    """Why the global batch does not split into micro-batches over the data-parallel ranks."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step != 0:
        return (f"--global-batch-size ({global_batch_size}) must be divisible by "
                f"--micro-batch-size x data-parallel size ({micro_batch_size} x "
                f"{data_parallel_size} = {per_step})")
    return None


def grouped_gemm_problem(dtype: str, hidden_size: int, ffn_per_rank: int) -> Optional[str]:
    """Why PyTorch's grouped GEMM (megatron_parm.experts.TorchGroupedMLP) cannot run experts of
    these widths in dtype ('fp32', 'bf16', 'fp16'): a sentence that says what to change; None
    where it can. Each row of its operands must start on a 16-byte boundary."""
    if dtype not in DTYPE_BYTES:
        return f"the grouped GEMM takes fp32, bf16 or fp16 weights, not {dtype}"
    step = GROUPED_GEMM_ALIGN_BYTES // DTYPE_BYTES[dtype]
    for flag, width in (("--hidden-size", hidden_size),
                        ("--moe-ffn-hidden-size / --expert-tensor-parallel-size", ffn_per_rank)):
        if width % step:
            return (f"{flag} gives rows of {width} {dtype} values ({width * DTYPE_BYTES[dtype]} "
                    f"bytes); the grouped GEMM needs a multiple of {step} values "
                    f"({GROUPED_GEMM_ALIGN_BYTES} bytes): change {flag}, or drop --moe-grouped-gemm")
    return None


PIPELINE_FLAG = "--pipeline-model-parallel-size"
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
UNEVEN_FLAGS = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
ACCOUNT_FLAGS = "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split"


def pipeline_stage_layers(num_layers: int, pp: int, vpp: Optional[int] = None,
                          first: Optional[int] = None, last: Optional[int] = None,
                          account_for_embedding: bool = False, account_for_loss: bool = False,
                          layout: Optional[str] = None, mtp_num_layers: Optional[int] = None):
    """Transformer layers per (stage, virtual stage), [pp][vpp or 1], as Megatron-Core 0.16.1
    builds them; or a str saying why that split is refused (naming the flags).

    first / last: --decoder-first/last-pipeline-num-layers (the middle stages share the rest);
    account_for_*: the embedding (and the loss) count as a layer of the first (last) virtual
    stage, which then builds one transformer layer fewer. layout: --pipeline-model-parallel-
    layout (its virtual stages per rank are vpp's, if given; mtp_num_layers: its m's), which
    excludes the other split flags."""
    if layout is not None:
        return _layout_stage_layers(layout, num_layers, pp, vpp, first, last,
                                    account_for_embedding or account_for_loss, mtp_num_layers)
    chunks = vpp or 1
    if pp == 1:
        if vpp is not None:
            return (f"interleaving (--virtual-pipeline-model-parallel-size / "
                    f"--num-layers-per-virtual-pipeline-stage) needs {PIPELINE_FLAG} > 1")
        if first is not None or last is not None or account_for_embedding or account_for_loss:
            return f"{UNEVEN_FLAGS} and {ACCOUNT_FLAGS} need {PIPELINE_FLAG} > 1"
        return [[num_layers]]
    if (first is not None or last is not None) and (account_for_embedding or account_for_loss):
        return (f"{UNEVEN_FLAGS} exclude {ACCOUNT_FLAGS} (Megatron-Core 0.16.1 refuses them "
                f"together): give one or the other")
    if first is not None or last is not None:
        ends = {0: first, pp - 1: last}
        middle_layers = num_layers - sum(v for v in ends.values() if v is not None)
        middle_stages = pp - sum(v is not None for v in ends.values())
        for flag, value in (("--decoder-first-pipeline-num-layers", first),
                            ("--decoder-last-pipeline-num-layers", last)):
            if value is not None and (value < 1 or value % chunks):
                return (f"{flag} ({value}) must be >= 1 and divisible by the virtual stages "
                        f"per pipeline rank ({chunks})")
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
                middle_stages and middle_layers % (middle_stages * chunks)):
            return (f"--num-layers ({num_layers}) minus {UNEVEN_FLAGS} leaves {middle_layers} "
                    f"layers for {middle_stages} middle pipeline stages x {chunks} virtual "
                    f"stages: they must divide evenly")
        per_middle = middle_layers // middle_stages if middle_stages else 0
        counts = [ends.get(stage) if ends.get(stage) is not None else per_middle
                  for stage in range(pp)]
        return [[count // chunks] * chunks for count in counts]
    slots = num_layers + account_for_embedding + account_for_loss
    if slots % (pp * chunks):
        extra = (f" + 1 for each of {ACCOUNT_FLAGS}" if account_for_embedding or account_for_loss
                 else "")
        what = (f"{PIPELINE_FLAG} x virtual stages per rank ({pp} x {chunks})" if vpp else
                f"{PIPELINE_FLAG} ({pp})")
        return f"--num-layers ({num_layers}{extra}) must be divisible by {what}"
    per_chunk = slots // (pp * chunks)
    layers = [[per_chunk] * chunks for _ in range(pp)]
    layers[0][0] -= account_for_embedding
    layers[-1][-1] -= account_for_loss
    if min(min(stage) for stage in layers) < 1:  # Megatron allows it; the MoE logging does not
        return (f"--num-layers ({num_layers}) leaves a pipeline stage without transformer "
                f"layers with {ACCOUNT_FLAGS} at {PIPELINE_FLAG} {pp}: every (virtual) stage "
                f"needs at least one")
    return layers


def _layout_stage_layers(layout: str, num_layers: int, pp: int, vpp: Optional[int], first,
                         last, account: bool, mtp_num_layers: Optional[int]):
    """pipeline_stage_layers for a --pipeline-model-parallel-layout."""
    if first is not None or last is not None or account:
        return (f"{LAYOUT_FLAG} places every layer itself: it excludes {UNEVEN_FLAGS} and "
                f"{ACCOUNT_FLAGS} (Megatron-Core 0.16.1 refuses them together)")
    stages = pipeline_layout(layout, pp, num_layers, mtp_num_layers)
    if isinstance(stages, str):
        return stages
    if pp == 1 and len(stages[0]) > 1:
        return f"{LAYOUT_FLAG} {layout}: virtual stages (interleaving) need {PIPELINE_FLAG} > 1"
    if vpp is not None and vpp != len(stages[0]):
        return (f"{LAYOUT_FLAG} {layout} has {len(stages[0])} virtual stages per pipeline rank, "
                f"not {vpp}")
    if len(stages[0]) > 1 and MTP in stages[0][-1]:
        # Megatron-Core 0.16.1 lets it through, then all-reduces that rank's two embedding
        # copies at start-up (a hang where the last stage shares them) and its gradients only
        # for the first chunk's copy
        return (f"{LAYOUT_FLAG} {layout}: the multi-token prediction layers (m) on the first "
                f"pipeline rank must be in its first virtual stage, with the embedding "
                f"(Megatron-Core 0.16.1 keeps the second copy of the word embeddings there out "
                f"of step): put them on another rank")
    return [[chunk.count(DECODER) for chunk in chunks] for chunks in stages]


def layout_virtual_stages(layout: str, pp: int):
    """Virtual stages per pipeline rank a --pipeline-model-parallel-layout gives (None: one, the
    plain 1F1B schedule), as Megatron-LM sets --virtual-pipeline-model-parallel-size from it;
    or a str saying why not."""
    stages = expand_pipeline_layout(layout)
    if isinstance(stages, str):
        return stages
    if len(stages) % pp:
        return (f"{LAYOUT_FLAG} {layout}: its {plural(len(stages), 'stage')} must be a multiple "
                f"of {PIPELINE_FLAG} ({pp}): pp x virtual stages per rank")
    return None if len(stages) == pp else len(stages) // pp


def virtual_stages(num_layers: int, pp: int, vpp: Optional[int],
                   layers_per_virtual_stage: Optional[int]):
    """Virtual stages per pipeline rank from --virtual-pipeline-model-parallel-size or
    --num-layers-per-virtual-pipeline-stage (Megatron-LM's two ways to ask), None without
    interleaving; or a str saying why not."""
    if vpp is not None and layers_per_virtual_stage is not None:
        return ("--virtual-pipeline-model-parallel-size and "
                "--num-layers-per-virtual-pipeline-stage exclude each other: give one")
    if layers_per_virtual_stage is not None:
        if layers_per_virtual_stage < 1:
            return (f"--num-layers-per-virtual-pipeline-stage must be >= 1, got "
                    f"{layers_per_virtual_stage}")
        if num_layers % (pp * layers_per_virtual_stage):
            return (f"--num-layers ({num_layers}) must be divisible by {PIPELINE_FLAG} x "
                    f"--num-layers-per-virtual-pipeline-stage ({pp} x {layers_per_virtual_stage})")
        vpp = num_layers // (pp * layers_per_virtual_stage)
    if vpp is not None and vpp < 1:
        return f"--virtual-pipeline-model-parallel-size must be >= 1, got {vpp}"
    return None if vpp == 1 else vpp  # one virtual stage: the plain 1F1B schedule


def microbatch_problem(num_microbatches: int, pp: int, vpp: Optional[int],
                       group_size: Optional[int] = None) -> Optional[str]:
    """Why num_microbatches (--global-batch-size / (--micro-batch-size x data-parallel size))
    cannot fill the pipeline, or None. Every stage needs at least pp micro-batches in flight
    (fewer leave stages idle for the whole step); interleaving runs them in groups of
    group_size (--microbatch-group-size-per-virtual-pipeline-stage, default pp), which
    Megatron-Core 0.16.1 takes between pp and the micro-batches, with a last group of none or
    at least pp."""
    if pp == 1:
        return None
    if num_microbatches < pp:
        return (f"--global-batch-size / (--micro-batch-size x data-parallel size) gives "
                f"{plural(num_microbatches, 'micro-batch')}, fewer than {PIPELINE_FLAG} ({pp}): "
                f"raise --global-batch-size to at least {pp} micro-batches")
    if vpp is None:
        return None
    group = pp if group_size is None else group_size
    if not pp <= group <= num_microbatches:
        return (f"{GROUP_FLAG} ({group}) must be between {PIPELINE_FLAG} ({pp}) and the "
                f"micro-batches per step ({num_microbatches})")
    if group_size is None and num_microbatches % pp:
        return (f"--global-batch-size / (--micro-batch-size x data-parallel size) gives "
                f"{plural(num_microbatches, 'micro-batch')}; interleaving (virtual pipeline "
                f"stages) needs a multiple of {PIPELINE_FLAG} ({pp})")
    if 0 < num_microbatches % group < pp:
        return (f"--global-batch-size / (--micro-batch-size x data-parallel size) gives "
                f"{plural(num_microbatches, 'micro-batch')}: in groups of {GROUP_FLAG} "
                f"({group}) the last holds {num_microbatches % group}, fewer than "
                f"{PIPELINE_FLAG} ({pp})")
    return None
    if num_microbatches < pp:
        return (f"--global-batch-size / (--micro-batch-size x data-parallel size) gives "
                f"{plural(num_microbatches, 'micro-batch')}, fewer than {PIPELINE_FLAG} ({pp}): "
                f"raise --global-batch-size to at least {pp} micro-batches")
    if vpp is not None and num_microbatches % pp:
        return (f"--global-batch-size / (--micro-batch-size x data-parallel size) gives "
                f"{plural(num_microbatches, 'micro-batch')}; interleaving (virtual pipeline "
                f"stages) needs a multiple of {PIPELINE_FLAG} ({pp})")
    return None


# ---------------------------------------------------------------------------------------------
# --pipeline-model-parallel-layout: Megatron-LM's string of the layers of every stage
# ---------------------------------------------------------------------------------------------

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
MTP_FLAG = "--mtp-num-layers"
# Megatron-LM's symbols: the embedding, a transformer (decoder) layer, a multi-token
# prediction layer, the output layer and loss; '|' ends a (virtual) stage
EMBEDDING, DECODER, MTP, LOSS = "E", "t", "m", "L"
STAGE_END = "|"


def expand_pipeline_layout(text: str):
    """A layout string -> its (virtual) stages in order, each a string of E, t, m, L; or a str
    saying why it does not read. Megatron-LM's notation: commas are cosmetic, 'x*N' repeats a
    symbol (or '|') N times, '(...)*N' repeats a group without nested parentheses N times:
    "Et*3|(tt|)*2,m|L" -> ['Ettt', 'tt', 'tt', 'm', 'L']."""
    text = str(text).replace(",", "")
    expanded, position = [], 0
    while position < len(text):
        char = text[position]
        if char == "(":
            close = text.find(")", position)
            body = text[position + 1:close] if close > 0 else ""
            if close < 0 or "(" in body or not body:
                return (f"{LAYOUT_FLAG} {text}: a group '(...)*N' must close and holds no "
                        f"other group")
            count, position = _repeat_count(text, close + 1)
            if count is None:
                return f"{LAYOUT_FLAG} {text}: the group ({body}) needs its count, ({body})*N"
            inner = expand_pipeline_layout(body)
            if isinstance(inner, str):
                return inner
            expanded.append(STAGE_END.join(inner) * count)
            continue
        if char not in (EMBEDDING, DECODER, MTP, LOSS, STAGE_END):
            return (f"{LAYOUT_FLAG} {text}: {char!r} is none of E (embedding), t (transformer "
                    f"layer), m (multi-token prediction layer), L (loss), | (end of a stage)")
        count, position = _repeat_count(text, position + 1)
        expanded.append(char * (1 if count is None else count))
    return "".join(expanded).split(STAGE_END)


def _repeat_count(text: str, position: int):
    """(N, the position after it) where '*N' starts at POSITION; (None, POSITION) otherwise."""
    if not text.startswith("*", position):
        return None, position
    end = position + 1
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == position + 1:
        return None, position
    return int(text[position + 1:end]), end


def pipeline_layout(text: str, pp: int, num_layers: int, mtp_num_layers: Optional[int] = None):
    """The layers of each (stage, virtual stage), [pp][vpp] strings of E, t, m, L, as
    Megatron-Core 0.16.1 places them (rank r's virtual stage v is the (v pp + r)-th stage of
    the string); or a str naming what Megatron-Core refuses of it."""
    stages = expand_pipeline_layout(text)
    if isinstance(stages, str):
        return stages
    where = f"{LAYOUT_FLAG} {text}"
    if len(stages) % pp:
        return (f"{where}: its {plural(len(stages), 'stage')} must be a multiple of "
                f"{PIPELINE_FLAG} ({pp}): pp x virtual stages per rank")
    vpp = len(stages) // pp
    flat = "".join(stages)
    counts = {symbol: flat.count(symbol) for symbol in (EMBEDDING, LOSS, DECODER, MTP)}
    if not flat.startswith(EMBEDDING) or not flat.endswith(LOSS) or counts[EMBEDDING] != 1 \
            or counts[LOSS] != 1:
        return f"{where}: E (the embedding) must come once, first, and L (the loss) once, last"
    if counts[DECODER] != num_layers:
        return (f"{where} holds {plural(counts[DECODER], 'transformer layer')} (t), "
                f"--num-layers is {num_layers}")
    if counts[MTP] != (mtp_num_layers or 0):
        return (f"{where} holds {plural(counts[MTP], 'multi-token prediction layer')} (m), "
                f"{MTP_FLAG} is {mtp_num_layers or 0}")
    if MTP in flat and DECODER in flat[flat.index(MTP):]:
        return f"{where}: the multi-token prediction layers (m) come after every t"
    layout = [[stages[chunk * pp + rank] for chunk in range(vpp)] for rank in range(pp)]
    for rank_stages in layout:
        if any(MTP in stage for stage in rank_stages[:-1]) or \
                rank_stages[-1].count(MTP) not in (0, counts[MTP]):
            return (f"{where}: Megatron-Core 0.16.1 builds every multi-token prediction layer "
                    f"(m) in one stage, the last virtual stage of its pipeline rank")
    return layout


def mtp_stages(layout) -> list:
    """The pipeline ranks whose stages hold the multi-token prediction layers."""
    return [rank for rank, chunks in enumerate(layout) if any(MTP in chunk for chunk in chunks)]
