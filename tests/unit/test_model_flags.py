"""Megatron-LM's model flags reach the model, and the model equals Megatron-Core's own.

In one process (world size 1, Megatron-Core's parallel_state): each flag is parsed as the
pretraining scripts parse it, the model built as the trainer builds it (training/model.py, with
ParmMoELayer and a dispatcher of the catalog), and compared with the model Megatron-LM's
builder makes from the same TransformerConfig (Megatron-Core's GPTModel / BertModel, its own
layer specs and MoELayer, the alltoall dispatcher): the same losses and gradients, from the
same seed. A flag that changes the numbers also changes them against a run without it (it
reaches the model); one that changes a module is checked on the module built.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from megatron_parm import schedules

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64
SEQ = 8
BATCH = 2
TINY = ["--num-layers", "2", "--hidden-size", "16", "--ffn-hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings",
        str(SEQ), "--micro-batch-size", str(BATCH), "--global-batch-size", str(BATCH),
        "--moe-aux-loss-coeff", "0.01"]
CONFIGS = {"gpt": str(REPO / "configs/gpt2_tiny_moe.yaml"),
           "bert": str(REPO / "configs/bert_tiny_moe.yaml")}
DISPATCHERS = list(schedules.names(schedules.BASELINE, schedules.PARM, schedules.AUTO))
ROPE = ["--position-embedding-type", "rope"]
SWIGLU = ["--swiglu"]


def parse(flags, model_type="gpt", world_size=1):
    from megatron_parm.training.arguments import parse_args

    bert = ["--bert-no-binary-head"] if model_type == "bert" else []
    return parse_args(["--config", CONFIGS[model_type], *TINY, *bert, *flags], model_type=model_type,
                      world_size=world_size, reads_data=False)


def refusal(flags, model_type="gpt", world_size=1) -> str:
    with pytest.raises(ValueError) as error:
        parse(flags, model_type, world_size)
    return str(error.value)


def _seed():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)


def build(args):
    """The model as the trainer builds it (from the same seed each time)."""
    from megatron_parm.training.model import build_model

    _seed()
    return build_model(args, VOCAB)


def megatron_lm_model(args):
    """The model Megatron-LM's builders (gpt_builder, pretrain_bert's) make of the config this
    project builds from ARGS: Megatron-Core's model and layer specs (its MoELayer, the
    alltoall dispatcher), from the same seed."""
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_layer_local_spec)
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_parm.data.vocab import padded_vocab_size
    from megatron_parm.training import mixed_precision
    from megatron_parm.training.model import build_config

    vocab = padded_vocab_size(VOCAB, 1)
    config = copy.copy(build_config(args))
    config.moe_token_dispatcher_type = "alltoall"
    _seed()
    if args.model_type == "gpt":
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm)
        model = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=SEQ,
                         share_embeddings_and_output_weights=True,
                         position_embedding_type=args.position_embedding_type,
                         rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                         rope_scaling=args.use_rope_scaling)
    else:
        moe = get_gpt_layer_local_spec(num_experts=args.num_experts).submodules.mlp
        spec = ModuleSpec(module=bert_layer_local_spec.module,
                          submodules=copy.copy(bert_layer_local_spec.submodules))
        spec.submodules.mlp = moe
        model = BertModel(config, num_tokentypes=0, transformer_layer_spec=spec,
                          vocab_size=vocab, max_sequence_length=SEQ, add_binary_head=False,
                          share_embeddings_and_output_weights=True)
    return mixed_precision.wrap(model, config)


def run(model, model_type="gpt"):
    """(losses [b, s], {parameter name: gradient}) of one forward and backward."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    model.zero_grad()
    _seed()  # the same draws for the router's jitter, random logits and dropout
    if model_type == "gpt":
        mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
        losses = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), mask, labels=labels)
    else:
        losses = model(tokens, torch.ones(BATCH, SEQ, dtype=torch.long), lm_labels=labels)
        losses = losses[0] if isinstance(losses, tuple) else losses
    losses.float().sum().backward()
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()
             if param.grad is not None}
    return losses.detach().float(), grads


def assert_same(result, reference, tol=1e-5):
    losses, grads = result
    torch.testing.assert_close(losses, reference[0], rtol=tol, atol=tol)
    assert grads.keys() == reference[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad.float(), reference[1][name].float(), rtol=tol, atol=tol,
                                   msg=name)


def differs(first, second) -> bool:
    """Whether two runs differ in their losses or a gradient."""
    close = lambda a, b: a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-6,
                                                               atol=1e-6)
    return not close(first[0], second[0]) or first[1].keys() != second[1].keys() or \
        not all(close(grad, second[1][name]) for name, grad in first[1].items())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: torch's thread pool only waits for its threads on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def attention_backend_env(monkeypatch):
    # Megatron-Core's language models set NVTE_*_ATTN for --attention-backend and refuse a
    # value set by an earlier model of another backend: each test starts without them.
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)


# (flags, the same run without the flag, model type, the TransformerConfig fields it sets).
# Each runs with one dispatcher of the catalog, in turn; the MoE flags below with every one.
SCALED_ROPE = [*ROPE, "--rotary-base", "1000000"]  # a frequency Llama-3.1's scaling changes
NUMERIC = [
    (["--bf16", "--attention-softmax-in-fp32"], ["--bf16"], "gpt",
     {"attention_softmax_in_fp32": True}),
    ([*SWIGLU, "--glu-linear-offset", "1.0"], SWIGLU, "gpt", {"glu_linear_offset": 1.0}),
    ([*SWIGLU, "--activation-func-clamp-value", "0.05"], SWIGLU, "gpt",
     {"activation_func_clamp_value": 0.05}),
    (["--squared-relu"], [], "gpt", {"gated_linear_unit": False}),
    (["--quick-geglu"], [], "gpt", {"gated_linear_unit": True}),
    (["--quick-geglu", "--glu-linear-offset", "0.5"], ["--quick-geglu"], "bert",
     {"glu_linear_offset": 0.5}),
    ([*ROPE, "--rotary-interleaved"], ROPE, "gpt", {"rotary_interleaved": True}),
    ([*SCALED_ROPE, "--use-rope-scaling"], SCALED_ROPE, "gpt", {}),
    ([*ROPE, "--no-rope-freq", "2"], ROPE, "gpt", {"no_rope_freq": [0, 1]}),
    (["--qk-l2-norm"], [], "gpt", {"qk_l2_norm": True}),
    (["--attention-output-gate"], [], "gpt", {"attention_output_gate": True}),
    (["--attention-output-gate"], [], "bert", {"attention_output_gate": True}),
    (["--softmax-type", "off-by-one"], [], "gpt", {"softmax_type": "off-by-one"}),
    (["--softmax-type", "learnable"], [], "bert", {"softmax_type": "learnable"}),
    (["--window-size", "(2, 0)", "--window-attn-skip-freq", "2"], [], "gpt",
     {"window_size": (2, 0), "window_attn_skip_freq": 2}),
    (["--embedding-init-method-std", "0.3"], [], "gpt", {"embedding_init_method_std": 0.3}),
    (["--init-method-xavier-uniform"], [], "bert",
     {"init_method": torch.nn.init.xavier_uniform_}),
    (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
      "0.01", "0.1"], [], "gpt", {"moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss"],
                                  "moe_aux_loss_coeff": [0.01, 0.1]}),
]


@pytest.mark.parametrize("index", range(len(NUMERIC)),
                         ids=[" ".join(flags[len(base):][:2]) + f" ({kind})"
                              for flags, base, kind, _ in NUMERIC])
def test_flag_reaches_the_model_and_matches_megatron_lm(megatron_world, index):
    flags, baseline, model_type, fields = NUMERIC[index]
    dispatcher = DISPATCHERS[index % len(DISPATCHERS)]
    args = parse([*flags, "--moe-token-dispatcher-type", dispatcher], model_type)
    model = build(args)
    config = model.config
    for field, value in fields.items():
        assert getattr(config, field) == value, field
    result = run(model, model_type)
    assert_same(result, run(megatron_lm_model(args), model_type))
    without = parse([*baseline, "--moe-token-dispatcher-type", dispatcher], model_type)
    assert differs(result, run(build(without), model_type)), "the flag changed nothing"


# MoE flags: every dispatcher against Megatron-Core's own MoELayer (and each changes the run).
MOE = [
    (["--moe-input-jitter-eps", "0.1"], {"moe_input_jitter_eps": 0.1}, []),
    (["--moe-router-force-load-balancing"], {"moe_router_force_load_balancing": True}, []),
    (["--moe-token-drop-policy", "position", "--moe-expert-capacity-factor", "0.5"],
     {"moe_token_drop_policy": "position"}, ["--moe-expert-capacity-factor", "0.5"]),
    (["--moe-apply-probs-on-input", "--moe-router-topk", "1"],
     {"moe_apply_probs_on_input": True}, ["--moe-router-topk", "1"]),
]


@pytest.mark.parametrize("flags,fields,baseline", MOE, ids=[case[0][0] for case in MOE])
def test_moe_flag_with_every_dispatcher_matches_megatron_lm(megatron_world, flags, fields,
                                                            baseline):
    args = parse(flags)
    reference = run(megatron_lm_model(args))
    assert differs(reference, run(megatron_lm_model(parse(baseline)))), \
        "the flag changed nothing"
    for dispatcher in DISPATCHERS:
        model = build(parse([*flags, "--moe-token-dispatcher-type", dispatcher]))
        for field, value in fields.items():
            assert getattr(model.config, field) == value, field
        assert_same(run(model), reference)


def test_moe_layer_recompute_is_selective_recompute_of_the_moe_layers(megatron_world):
    args = parse(["--moe-layer-recompute", "--moe-token-dispatcher-type", "parm_s2"])
    assert (args.recompute_granularity, args.recompute_modules) == ("selective",
                                                                     ["core_attn", "moe"])
    model = build(args)
    assert model.config.moe_layer_recompute
    from megatron_parm.training.model import moe_layers

    assert all(layer.moe_layer_recompute for layer in moe_layers(model))
    assert_same(run(model), run(build(parse(["--moe-token-dispatcher-type", "parm_s2"]))))
    assert "--moe-layer-recompute cannot go with --recompute-granularity full" in refusal(
        ["--moe-layer-recompute", "--recompute-granularity", "full", "--recompute-method",
         "uniform", "--recompute-num-layers", "1"])


def test_query_key_layer_scaling_scales_by_the_layer_number(megatron_world):
    args = parse(["--apply-query-key-layer-scaling", "--bf16"])
    assert args.attention_softmax_in_fp32  # Megatron-LM's implication
    model = build(args)
    assert model.config.apply_query_key_layer_scaling and model.config.attention_softmax_in_fp32
    for number, layer in enumerate(model.module.decoder.layers, start=1):
        softmax = layer.self_attention.core_attention.scale_mask_softmax
        assert (softmax.scale, softmax.softmax_in_fp32) == (number, True)
    assert_same(run(model), run(megatron_lm_model(args)))


def test_softmax_runs_in_the_model_precision_unless_asked(megatron_world):
    """Megatron-LM's default (--attention-softmax-in-fp32 off) runs the local attention's
    softmax in bf16."""
    model = build(parse(["--bf16"]))
    assert not model.config.attention_softmax_in_fp32
    softmax = model.module.decoder.layers[0].self_attention.core_attention.scale_mask_softmax
    assert softmax.input_in_bf16 and not softmax.softmax_in_fp32


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_stores_gamma_minus_one(megatron_world, normalization):
    from megatron_parm.mcore_compat import ZeroCenteredLayerNorm, ZeroCenteredRMSNorm

    flags = ["--normalization", normalization, "--moe-token-dispatcher-type", "parm_s1"]
    args = parse(["--apply-layernorm-1p", *flags])
    model, plain = build(args), build(parse(flags))
    assert model.config.layernorm_zero_centered_gamma
    norm_class = ZeroCenteredLayerNorm if normalization == "LayerNorm" else ZeroCenteredRMSNorm
    norms = [module for module in model.modules() if isinstance(module, norm_class)]
    assert len(norms) == 5  # two per layer and the final one
    assert all(not norm.weight.any() for norm in norms)
    # gamma - 1 = w here is gamma = 1 + w in torch's norm: the same model
    plain_norms = [module for module in plain.modules()
                   if type(module) is getattr(torch.nn, normalization)]
    with torch.no_grad():
        for norm, plain_norm in zip(norms, plain_norms):
            norm.weight.normal_(0, 0.1)
            plain_norm.weight.copy_(norm.weight + 1)
    losses, grads = run(model)
    plain_losses, plain_grads = run(plain)
    torch.testing.assert_close(losses, plain_losses, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_qk_l2_norm_normalizes_queries_and_keys(megatron_world):
    from megatron.core.transformer.torch_norm import L2Norm

    model = build(parse(["--qk-l2-norm"]))
    for layer in model.decoder.layers:
        assert isinstance(layer.self_attention.q_layernorm, L2Norm)
        assert isinstance(layer.self_attention.k_layernorm, L2Norm)


def test_rotary_flags(megatron_world):
    args = parse(["--use-rotary-position-embeddings", "--use-rope-scaling", "--rope-type",
                  "rope", "--rotary-base", "1000000"])
    assert args.position_embedding_type == "rope"
    scaled = build(args).rotary_pos_emb
    plain = build(parse(SCALED_ROPE)).rotary_pos_emb
    assert scaled.inv_freq.tolist() != plain.inv_freq.tolist()  # Llama-3.1's low frequencies
    assert "--rope-type yarn needs --multi-latent-attention (standard attention takes rope " \
        "only, as in Megatron-LM)" in refusal(["--rope-type", "yarn", *ROPE])


def test_initialization_flags(megatron_world, monkeypatch):
    model = build(parse(["--embedding-init-method-std", "0.5"]))
    assert 0.4 < model.embedding.word_embeddings.weight.std().item() < 0.6
    xavier = build(parse(["--init-method-xavier-uniform"]))
    assert xavier.config.output_layer_init_method is torch.nn.init.xavier_uniform_
    fc2 = xavier.decoder.layers[0].self_attention.linear_proj.weight  # [16, 16]
    assert fc2.abs().max().item() <= (6 / 32) ** 0.5
    calls = []  # Megatron-Core's normal initializations (std given; torch's own take none)
    normal = torch.nn.init.normal_
    monkeypatch.setattr(torch.nn.init, "normal_",
                        lambda tensor, *a, **k: ("std" in k and calls.append(1))
                        or normal(tensor, *a, **k))
    assert not build(parse(["--no-initialization"])).config.perform_initialization
    assert calls == []
    build(parse([]))
    assert calls
    assert build(parse(["--use-cpu-initialization"])).config.use_cpu_initialization


def test_data_parallel_random_init_seeds_each_rank(megatron_world, monkeypatch):
    from megatron.core import parallel_state

    from megatron_parm.training.trainer import set_seed

    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda *a, **k: 3)
    set_seed(1234, data_parallel_random_init=True)
    assert torch.initial_seed() == 1234 + 30
    set_seed(1234)
    assert torch.initial_seed() == 1234


def test_attention_backend(megatron_world):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    model = build(parse(["--attention-backend", "unfused"]))
    assert model.config.attention_backend == AttnBackend.unfused
    # local modules: Megatron-Core's DotProductAttention whatever the value (as Megatron-LM)
    assert type(model.decoder.layers[0].self_attention.core_attention) is DotProductAttention
    assert os.environ["NVTE_UNFUSED_ATTN"] == "1" and os.environ["NVTE_FLASH_ATTN"] == "0"
    assert "--attention-backend flash: BERT's local attention" in refusal(
        ["--attention-backend", "flash"], "bert")


@pytest.mark.parametrize("flags,model_type,message", [
    (["--rotary-interleaved"], "gpt", "--rotary-interleaved needs --position-embedding-type rope"),
    (["--no-rope-freq", "3", *ROPE], "gpt", "Megatron-Core 0.16.1 refuses these flags"),
    (["--qk-l2-norm"], "bert", "--qk-l2-norm applies to GPT models"),
    (["--window-size", "(4, 0)"], "bert", "--window-size applies to GPT models"),
    (["--window-size", "4"], "gpt", "--window-size takes two integers"),
    (["--window-attn-skip-freq", "2"], "gpt", "--window-attn-skip-freq needs --window-size"),
    (["--squared-relu", "--swiglu"], "gpt", "--swiglu and --squared-relu both pick"),
    (["--glu-linear-offset", "1"], "gpt", "--glu-linear-offset applies to gated MLPs"),
    (["--quick-geglu", "--moe-grouped-gemm"], "gpt",
     "--quick-geglu with --moe-grouped-gemm: Megatron-Core 0.16.1's GroupedMLP"),
    (["--moe-apply-probs-on-input"], "gpt", "--moe-apply-probs-on-input needs --moe-router-topk 1"),
    (["--moe-token-drop-policy", "position"], "gpt",
     "--moe-token-drop-policy applies with --moe-expert-capacity-factor"),
    (["--moe-input-jitter-eps", "1.5"], "gpt", "--moe-input-jitter-eps must be a number in (0, 1)"),
    (["--fp32-residual-connection", "--bf16"], "gpt",
     "--fp32-residual-connection needs --transformer-impl transformer_engine"),
    (["--fp32-residual-connection"], "gpt", "--fp32-residual-connection needs --bf16 or --fp16"),
    (["--grad-reduce-in-bf16"], "gpt", "--grad-reduce-in-bf16 needs --bf16"),
    (["--encoder-num-layers", "3"], "gpt", "--num-layers (2) and --encoder-num-layers (3)"),
    (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], "gpt",
     "--moe-aux-loss-coeff needs one coefficient per --moe-router-load-balancing-type (2 types, "
     "1 coefficient)"),
    (["--moe-router-load-balancing-type", "sinkhorn", "aux_loss", "--moe-aux-loss-coeff", "0",
      "0.1"], "gpt", "sinkhorn runs alone"),
    (["--ddp-num-buckets", "2", "--ddp-bucket-size", "1000"], "gpt",
     "--ddp-num-buckets and --ddp-bucket-size both size"),
    (["--ddp-reduce-scatter-with-fp32-accumulation"], "gpt", "needs --use-distributed-optimizer"),
    (["--qk-clip"], "gpt", "--qk-clip: needs Transformer Engine's attention"),
    (["--moe-latent-size", "8"], "gpt", "--moe-latent-size 8: needs Transformer Engine"),
    (["--moe-use-upcycling"], "gpt", "--moe-use-upcycling needs --load"),
    (["--moe-upcycling-granularity", "2"], "gpt",
     "--moe-upcycling-granularity needs --moe-use-upcycling"),
    (["--moe-use-upcycling", "--load", "a", "--save", "a"], "gpt", "must be different folders"),
    (["--moe-use-upcycling", "--load", "a", "--save", "b", "--moe-layer-freq", "[0,1]"], "gpt",
     "needs an MoE layer in every layer"),
    (["--moe-use-upcycling", "--load", "a", "--save", "b", "--moe-upcycling-granularity", "3"],
     "gpt", "--num-experts (4) must be a multiple of the 3 slices"),
])
def test_what_does_not_go_together_is_one_line_naming_the_flag(flags, model_type, message):
    assert message in refusal(flags, model_type)


def test_upcycling_needs_the_dense_model_s_shards():
    assert "--moe-use-upcycling needs --expert-tensor-parallel-size equal to" in refusal(
        ["--moe-use-upcycling", "--load", "a", "--save", "b", "--tensor-model-parallel-size",
         "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel", "--global-batch-size",
         "4"], world_size=4)


def test_encoder_num_layers_is_num_layers():
    from megatron_parm import settings

    args = parse(["--encoder-num-layers", "2"])
    assert args.num_layers == 2
    note = settings.no_effect_note(parse(["--decoder-num-layers", "4",
                                          "--rotary-seq-len-interpolation-factor", "2"]))
    assert "--decoder-num-layers: sets the decoder of T5 models" in note
    assert "--rotary-seq-len-interpolation-factor: Megatron-LM 0.16.1 hands it" in note


def test_several_load_balancing_losses_reach_the_router_and_the_log():
    from megatron_parm.training.moe_log import router_loss_names

    args = parse(["--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
                  "--moe-aux-loss-coeff", "0.1", "0.01", "--moe-z-loss-coeff", "0.001"])
    assert router_loss_names(args) == ["seq_load_balancing_loss", "global_load_balancing_loss",
                                       "z_loss"]
    assert parse(["--moe-router-load-balancing-type", "seq_aux_loss"]) \
        .moe_router_load_balancing_type == "seq_aux_loss"


def test_pipeline_flags():
    from megatron_parm.training.model import build_config

    pipeline = ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "12"]
    args = parse([*pipeline, "--microbatch-group-size-per-virtual-pipeline-stage", "4"],
                 world_size=2)
    assert build_config(args).microbatch_group_size_per_vp_stage == 4
    assert build_config(parse(pipeline, world_size=2)).microbatch_group_size_per_vp_stage == 2
    # Megatron-Core's rules: between pp and the micro-batches; a last group of 0 or >= pp
    assert "in groups of --microbatch-group-size-per-virtual-pipeline-stage (5) the last " \
           "holds 1" in refusal([*pipeline, "--microbatch-group-size-per-virtual-pipeline-stage",
                                 "5"], world_size=2)
    assert "(13) must be between --pipeline-model-parallel-size (2) and the micro-batches" in \
        refusal([*pipeline, "--microbatch-group-size-per-virtual-pipeline-stage", "13"],
                world_size=2)
    assert "needs --num-virtual-stages-per-pipeline-rank" in refusal(
        ["--microbatch-group-size-per-virtual-pipeline-stage", "2"])
    assert parse([*pipeline, "--use-tp-pp-dp-mapping"], world_size=2).use_tp_pp_dp_mapping
    # Megatron-Core's rule where the stages are not outermost: the experts' data-parallel size
    # is attention's
    assert "--expert-model-parallel-size x --expert-tensor-parallel-size (2 x 1) must equal " \
           "--tensor-model-parallel-size x --context-parallel-size (1 x 1)" in \
        refusal([*pipeline, "--use-tp-pp-dp-mapping", "--expert-model-parallel-size", "2"],
                world_size=4)


@pytest.mark.parametrize("tp,ep,etp,world", [(2, 2, 1, 8), (1, 4, 2, 8), (2, 4, 2, 16)])
def test_tp_pp_dp_order_is_megatrons_default_without_pipelining(tp, ep, etp, world):
    """Why --use-tp-pp-dp-mapping needs nothing here at pp 1: Megatron-Core makes the same
    groups in both orders."""
    from megatron.core.parallel_state import RankGenerator

    for group_tp, group_ep, names in ((tp, 1, ("tp", "dp", "pp", "tp-dp", "tp-pp")),
                                      (etp, ep, ("tp", "ep", "dp", "pp", "tp-ep"))):
        dp = world // (group_tp * group_ep)
        orders = [RankGenerator(tp=group_tp, ep=group_ep, dp=dp, pp=1, cp=1, order=order)
                  for order in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")]
        for name in names:
            assert orders[0].get_ranks(name) == orders[1].get_ranks(name), name


@pytest.mark.parametrize("tp,cp,ep,etp,world", [(2, 1, 2, 1, 8), (4, 1, 2, 2, 16),
                                                 (1, 2, 2, 1, 8), (2, 2, 2, 2, 16)])
def test_tp_pp_dp_order_keeps_the_dispatchers_groups_under_pipelining(tp, cp, ep, etp, world):
    """layout_rules.RANK_ORDERS: at pp 2 Megatron-Core's two orders make the same TP, CP and
    ESP x EP groups (the dispatchers', parm_hier's node split and the per-layer plans hold in
    both), and other pipeline groups."""
    from megatron.core.parallel_state import RankGenerator

    from megatron_parm.layout_rules import RANK_ORDERS, rank_order_problem

    assert rank_order_problem(True, tp, cp, ep, etp, 2) is None
    for group_tp, group_cp, group_ep, names in ((tp, cp, 1, ("tp", "cp", "tp-cp")),
                                                (etp, 1, ep, ("tp", "ep", "tp-ep"))):
        dp = world // (group_tp * group_cp * group_ep * 2)
        orders = [RankGenerator(tp=group_tp, ep=group_ep, dp=dp, pp=2, cp=group_cp, order=order)
                  for order in RANK_ORDERS.values()]
        for name in names:
            assert orders[0].get_ranks(name) == orders[1].get_ranks(name), name
        assert orders[0].get_ranks("pp") != orders[1].get_ranks("pp")


def test_data_parallel_gradient_flags(megatron_world):
    from megatron.core.distributed import param_and_grad_buffer

    from megatron_parm.training import ddp

    args = parse(["--bf16", "--grad-reduce-in-bf16", "--ddp-num-buckets", "3"])
    model = build(args)
    config = ddp.ddp_config(args, [model])
    assert not config.grad_reduce_in_fp32 and not args.accumulate_allreduce_grads_in_fp32
    assert config.bucket_size == sum(p.nelement() for p in model.parameters()) // 3
    assert ddp.ddp_config(parse(["--bf16"]), [model]).grad_reduce_in_fp32
    fp32_rs = parse(["--use-distributed-optimizer",
                     "--ddp-reduce-scatter-with-fp32-accumulation"])
    config = ddp.ddp_config(fp32_rs, [model])
    assert config.reduce_scatter_with_fp32_accumulation
    ddp.WeakHookDDP(model.config, config, build(fp32_rs))
    assert param_and_grad_buffer.dist_reduce_scatter_func.__name__ == \
        "reduce_scatter_with_fp32_accumulation"
    ddp.ddp_config(parse([]), [model])  # a later run without it: Megatron-Core's own again
    assert param_and_grad_buffer.dist_reduce_scatter_func is ddp._REDUCE_SCATTER
