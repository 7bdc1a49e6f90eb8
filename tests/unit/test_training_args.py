"""Start-up checks of the pretraining flags (in-process, no process group) and log formats."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_parm.training.arguments import parse_args
from megatron_parm.training.log import iteration_line, validation_block

REPO = Path(__file__).resolve().parents[2]
TINY_GPT = ["--config", str(REPO / "configs/gpt2_tiny_moe.yaml")]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch, prepared_data):
    # The configs name data and tokenizer paths relative to the repository root.
    monkeypatch.chdir(REPO)


def error(argv, world_size=4, model_type="gpt") -> str:
    with pytest.raises(ValueError) as info:
        parse_args(argv, model_type=model_type, world_size=world_size)
    return str(info.value)


def test_tiny_configs_parse():
    args = parse_args(TINY_GPT, world_size=1)
    assert (args.num_layers, args.hidden_size, args.num_experts) == (2, 64, 4)
    assert args.num_microbatches == args.global_batch_size // args.micro_batch_size
    bert = parse_args(["--config", "configs/bert_tiny_moe.yaml"], model_type="bert", world_size=1)
    assert bert.data_path == ["data/cache/bert_text_sentence"]


def test_command_line_overrides_config():
    args = parse_args(TINY_GPT + ["--hidden-size", "128", "--moe-token-dispatcher-type",
                                  "parm_s1"], world_size=1)
    assert args.hidden_size == 128 and args.moe_token_dispatcher_type == "parm_s1"
    assert args.num_layers == 2  # still from the config


def test_missing_data_prefix_names_flag():
    assert "--data-path" in error(TINY_GPT + ["--data-path", "data/cache/nope_text_document"])


def test_missing_tokenizer_model_names_flag():
    assert "--tokenizer-model" in error(TINY_GPT + ["--tokenizer-model", "nope.model"])


def test_data_flags_megatron_lm_s_rules(tmp_path):
    """One data source; --split's default Megatron-LM's spelling, no --split with per-split
    paths; --encoder-seq-length is --seq-length's other name; --mock-data for GPT only; the
    NullTokenizer needs --vocab-size; --phase-transition-iterations read as iterations; the same
    keys in a --config file."""
    prefix = "data/cache/gpt_text_document"
    no_split = [a for a in TINY_GPT] + ["--split", "969, 30, 1"]
    assert parse_args(no_split, world_size=1).split == "969, 30, 1"
    per_split = TINY_GPT + ["--data-path", "", "--train-data-path", prefix]
    assert error(per_split + ["--split", "98,2,0"]).startswith("--split 98,2,0: the "
                                                              "--train/valid/test-data-path")
    mock = TINY_GPT + ["--data-path", "", "--mock-data", "--tokenizer-type", "NullTokenizer"]
    assert error(mock) == "--vocab-size is required with --tokenizer-type NullTokenizer"
    assert parse_args(mock + ["--vocab-size", "100"], world_size=1).mock_data
    assert error(TINY_GPT + ["--mock-data"]).startswith("--mock-data and --data-path: give a "
                                                        "single data source")
    bert = ["--config", "configs/bert_tiny_moe.yaml", "--data-path", "", "--mock-data"]
    assert error(bert, model_type="bert").startswith("--mock-data: Megatron-Core 0.16.1 has a "
                                                     "mock dataset for GPT only")
    assert error(TINY_GPT + ["--encoder-seq-length", "64"]).startswith(
        "--encoder-seq-length 64 and --seq-length 64: give one of the two")
    config = tmp_path / "encoder.yaml"
    config.write_text("\n".join(line for line in (REPO / "configs/gpt2_tiny_moe.yaml").read_text()
                                .splitlines() if not line.startswith("seq_length"))
                      + "\nencoder_seq_length: 32\nphase_transition_iterations: '30, 10'\n")
    args = parse_args(["--config", str(config)], world_size=1)
    assert args.seq_length == 32 and args.phase_transition_iterations == [10, 30]
    assert error(TINY_GPT + ["--phase-transition-iterations", "10,x"]).startswith(
        "--phase-transition-iterations: expected comma-separated iteration numbers")
    assert error(TINY_GPT + ["--dataloader-type", "external"]).startswith(
        "not available here: --dataloader-type external: external passes")


def test_huggingface_tokenizer_needs_a_directory_with_tokenizer_json(tmp_path):
    hf = TINY_GPT + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    assert error(hf + [str(tmp_path / "nope")]).startswith(
        f"--tokenizer-model: not a directory: {tmp_path / 'nope'}")
    assert error(hf + [str(tmp_path)]) == f"--tokenizer-model: no tokenizer.json in {tmp_path}"
    (tmp_path / "tokenizer.json").write_text("{}")  # read when training builds the tokenizer
    assert parse_args(hf + [str(tmp_path)], world_size=1).tokenizer_model == str(tmp_path)


def test_global_batch_not_divisible_names_flags():
    message = error(TINY_GPT + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--expert-model-parallel-size", "2",
                                "--micro-batch-size", "4", "--global-batch-size", "12"])
    assert "--global-batch-size" in message and "--micro-batch-size" in message


def test_seq_length_over_max_positions_names_flags():
    message = error(TINY_GPT + ["--seq-length", "128"])
    assert "--seq-length" in message and "--max-position-embeddings" in message


def test_bad_layout_names_flag():
    assert "--expert-model-parallel-size" in error(TINY_GPT + ["--expert-model-parallel-size", "3"])
    assert "--sequence-parallel" in error(TINY_GPT + ["--tensor-model-parallel-size", "2",
                                                      "--moe-token-dispatcher-type", "alltoall"])


def test_ranks_per_node_must_divide_the_world():
    assert "--parm-ranks-per-node (3) must divide the world size (4)" in error(
        TINY_GPT + ["--parm-ranks-per-node", "3"])
    assert "--parm-ranks-per-node must be a positive integer" in error(
        TINY_GPT + ["--parm-ranks-per-node", "0"])
    args = parse_args(TINY_GPT + ["--parm-ranks-per-node", "2", "--moe-token-dispatcher-type",
                                  "parm_hier"], world_size=4)
    assert args.parm_ranks_per_node == 2


def test_parm_hier_needs_ep_groups_that_split_evenly_by_node():
    """12 ranks, 3 per node, EP groups of 4: a group holds 3 ranks on one node and 1 on the
    next. parm_hier is refused naming the flags and the group; parm takes the layout (its
    layers leave parm_hier out with one line)."""
    flags = TINY_GPT + ["--parm-ranks-per-node", "3", "--expert-model-parallel-size", "4",
                        "--global-batch-size", "48", "--moe-token-dispatcher-type"]
    for name in ("parm_hier", "parm_hier_s2"):  # the catalog's splits_ep_by_node
        message = error(flags + [name], world_size=12)
        assert message.startswith(f"--moe-token-dispatcher-type {name} with --parm-ranks-per-node "
                                  "3: the EP group [0, 1, 2, 3] does not split evenly by node"), message
    assert parse_args(flags + ["parm"], world_size=12).moe_token_dispatcher_type == "parm"


@pytest.mark.parametrize("flags,message", [
    (["--recompute-method", "uniform"], "--recompute-method needs --recompute-granularity"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
      "3"], "--recompute-num-layers (3) must be at most the layers of a pipeline stage (2)"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "--recompute-method and --recompute-num-layers apply to --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1", "--recompute-modules", "moe"],
     "--recompute-modules applies to --recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
     "--recompute-modules moe_act needs --moe-grouped-gemm"),
])
def test_recompute_flags_follow_megatron_lm_rules(flags, message):
    assert message in error(TINY_GPT + flags, world_size=1)


def test_recompute_flags_reach_the_config():
    from megatron_parm.training.model import build_config

    config = build_config(parse_args(TINY_GPT + ["--recompute-granularity", "selective",
                                                 "--recompute-modules", "moe", "layernorm"],
                                     world_size=1))
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["moe", "layernorm"]
    config = build_config(parse_args(TINY_GPT, world_size=1))
    assert config.recompute_granularity is None


def test_unknown_config_key_and_dispatcher():
    assert "--config" in error(["--config", "nope.yaml"])
    with pytest.raises(SystemExit):  # argparse's own error for a value outside the choices
        parse_args(TINY_GPT + ["--moe-token-dispatcher-type", "nope"], world_size=1)


def test_checks_run_before_any_process_group():
    import torch

    error(TINY_GPT + ["--seq-length", "128"])
    assert not torch.distributed.is_initialized()


def test_iteration_line_matches_megatron_lm():
    line = iteration_line(10, 100, 640, 123.44, 1e-4, 64,
                          {"lm loss": 6.123456, "load balancing loss": 1.01}, 2048.0, 0.5)
    assert line.startswith(" iteration       10/     100 | consumed samples:          640 | "
                           "elapsed time per iteration (ms): 123.4 | learning rate: 1.000000E-04 | "
                           "global batch size:    64 | lm loss: 6.123456E+00 | "
                           "load balancing loss: 1.010000E+00 |")
    assert re.search(r"tokens per second: 2048\.0 \|$", line)
    block = validation_block("iteration 10", {"lm loss": 2.0})
    assert " validation loss at iteration 10 | lm loss value: 2.000000E+00 | lm loss PPL:" in block


def test_moe_with_biases_needs_etp_1(tmp_path):
    import yaml

    values = yaml.safe_load((REPO / "configs/gpt2_tiny_moe.yaml").read_text())
    values["disable_bias_linear"] = False
    config = tmp_path / "biased.yaml"
    config.write_text(yaml.safe_dump(values))
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--expert-model-parallel-size", "2"]
    message = error(["--config", str(config)] + layout)  # ETP defaults to TP = 2
    assert "--expert-tensor-parallel-size 1" in message and "--disable-bias-linear" in message
    args = parse_args(["--config", str(config), "--openai-gelu"] + layout
                      + ["--expert-tensor-parallel-size", "1"], world_size=4)
    assert args.openai_gelu and not args.disable_bias_linear


def test_iteration_line_has_loss_scale_and_nan_iterations():
    line = iteration_line(10, 100, 640, 123.44, 1e-4, 64, {"lm loss": 6.1}, 2048.0, 0.5,
                          skipped=2, loss_scale=65536.0, nan_iterations=1)
    assert ("| lm loss: 6.100000E+00 | loss scale: 65536.0 | grad norm: 0.500 | number of "
            "skipped iterations:   2 | number of nan iterations:   1 | tokens per second:") in line


def test_the_docs_example_log_line_is_what_the_trainer_prints():
    """docs/pretraining.md's example iteration line, printed again from its own values by
    iteration_line: every field, in order and format (loss scale, number of nan iterations)."""
    text = (REPO / "docs/pretraining.md").read_text()
    example = next(line for line in text.split("## What the log shows", 1)[1].splitlines()
                   if line.startswith(" iteration "))
    head, *parts = [part.strip() for part in example.strip(" |").split(" | ")]
    fields = dict(part.split(": ", 1) for part in parts)
    iteration, train_iters = (int(n) for n in re.findall(r"\d+", head))
    losses = {name: float(value) for name, value in fields.items()
              if name.endswith("loss") and name != "loss scale"}
    again = iteration_line(
        iteration, train_iters, int(fields["consumed samples"]),
        float(fields["elapsed time per iteration (ms)"]), float(fields["learning rate"]),
        int(fields["global batch size"]), losses, float(fields["tokens per second"]),
        float(fields["grad norm"]), skipped=int(fields["number of skipped iterations"]),
        loss_scale=float(fields["loss scale"]),
        nan_iterations=int(fields["number of nan iterations"]))
    assert example == again


def test_the_last_line_says_whose_loss_it_is(capsys):
    """The end of a run names its loss as one iteration's, unlike the iteration lines' interval
    means (Megatron-LM's lines name each value)."""
    from megatron_parm.training.log import TrainingLog

    args = parse_args(TINY_GPT + ["--train-iters", "40", "--log-interval", "5"], world_size=1,
                      reads_data=False)
    TrainingLog(args, True, 0, "", 512).done(40, {"losses": [7.0, 6.6823], "checkpoint": None})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("> done: 40 iterations; lm loss of iteration 40: 6.682300E+00 (an "
                        "iteration line's lm loss is its interval's mean, --log-interval 5)"), lines


def one_line_error(argv) -> str:
    message = error(argv)
    assert "\n" not in message, message
    assert not torch.distributed.is_initialized()  # refused before any process group
    return message


def test_mixed_precision_flags():
    args = parse_args(TINY_GPT + ["--bf16"], world_size=1)
    assert args.bf16 and args.accumulate_allreduce_grads_in_fp32 and args.loss_scale is None
    args = parse_args(TINY_GPT + ["--fp16"], world_size=1)
    assert (args.initial_loss_scale, args.min_loss_scale, args.loss_scale_window,
            args.hysteresis) == (2.0 ** 32, 1.0, 1000, 2)  # Megatron-LM's defaults
    assert not args.accumulate_allreduce_grads_in_fp32
    assert "--bf16 and --fp16" in one_line_error(TINY_GPT + ["--bf16", "--fp16"])
    assert "--initial-loss-scale" in one_line_error(TINY_GPT + ["--bf16", "--initial-loss-scale", "1024"])
    assert "--loss-scale" in one_line_error(TINY_GPT + ["--loss-scale", "128"])
    assert "--hysteresis" in one_line_error(TINY_GPT + ["--fp16", "--hysteresis", "0"])


def test_expert_implementations_without_their_packages():
    # Without grouped_gemm and TE, --moe-grouped-gemm runs on PyTorch's grouped_mm.
    from megatron_parm.training.implementation import expert_implementation

    for dtype in ([], ["--bf16"]):
        args = parse_args(TINY_GPT + dtype + ["--moe-grouped-gemm"], world_size=1)
        assert args.moe_grouped_gemm
    assert expert_implementation("local", True, cuda=False, bf16=True) == "TorchGroupedMLP"
    assert expert_implementation("local", False, cuda=False, bf16=True) == "SequentialMLP"
    assert expert_implementation("transformer_engine", True, cuda=True, bf16=True) == "TEGroupedMLP"
    message = one_line_error(TINY_GPT + ["--transformer-impl", "transformer_engine"])
    assert "--transformer-impl transformer_engine" in message and "transformer-engine" in message
    message = one_line_error(TINY_GPT + ["--moe-grouped-gemm", "--transformer-impl",
                                         "transformer_engine"])
    assert "--transformer-impl transformer_engine" in message and "transformer-engine" in message
    assert parse_args(TINY_GPT, world_size=1).transformer_impl == "local"


def test_grouped_gemm_refuses_widths_it_cannot_take():
    """16-byte rows: a bf16 hidden size of 36 (72 bytes) is refused, naming the flag and the fix;
    the same width runs in fp32 (144 bytes)."""
    flags = ["--moe-grouped-gemm", "--hidden-size", "36", "--num-attention-heads", "4"]
    message = one_line_error(TINY_GPT + flags + ["--bf16"])
    assert message.startswith("--moe-grouped-gemm: --hidden-size gives rows of 36 bf16 values")
    assert "multiple of 8" in message
    parse_args(TINY_GPT + flags, world_size=1)
    message = one_line_error(TINY_GPT + ["--moe-grouped-gemm", "--moe-ffn-hidden-size", "66",
                                         "--expert-tensor-parallel-size", "2",
                                         "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert "--moe-ffn-hidden-size / --expert-tensor-parallel-size gives rows of 33" in message


def test_training_and_the_planner_refuse_a_layout_alike():
    """One rule, one message (layout_rules): the expert FFN must split over ETP."""
    from megatron_parm.perf_model.layout import Layout
    from megatron_parm.perf_model.transformer import ModelSpec, check_layout

    flags = ["--tensor-model-parallel-size", "4", "--sequence-parallel",
             "--expert-tensor-parallel-size", "4", "--moe-ffn-hidden-size", "6"]
    message = error(TINY_GPT + flags)
    assert message == ("--moe-ffn-hidden-size (6) must be divisible by "
                       "--expert-tensor-parallel-size (4)")
    args = parse_args(TINY_GPT, world_size=1)
    spec = ModelSpec(model_type="gpt", num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                     vocab_size=1000, num_experts=args.num_experts, moe_ffn_hidden_size=6,
                     topk=args.moe_router_topk)
    assert check_layout(spec, Layout(tp=4, ep=1, etp=4, nodes=1, ranks_per_node=4)) == message


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism: the flags, and the bad input each gets one line for
# ---------------------------------------------------------------------------------------------

PIPELINE = TINY_GPT + ["--num-layers", "4", "--micro-batch-size", "2", "--global-batch-size",
                       "8", "--pipeline-model-parallel-size", "2"]


def test_pipeline_flags_parse():
    args = parse_args(PIPELINE, world_size=4)
    assert (args.data_parallel_size, args.num_microbatches) == (2, 2)
    assert args.virtual_pipeline_model_parallel_size is None
    # Megatron-LM's two ways to ask for interleaving resolve to the same thing
    for flags in (["--num-layers-per-virtual-pipeline-stage", "1"],
                  ["--virtual-pipeline-model-parallel-size", "2"]):
        assert parse_args(PIPELINE + flags, world_size=4).virtual_pipeline_model_parallel_size == 2
    uneven = parse_args(PIPELINE + ["--num-layers", "5", "--decoder-first-pipeline-num-layers",
                                    "2"], world_size=4)
    assert uneven.decoder_first_pipeline_num_layers == 2


def test_pipeline_stage_layers_as_megatron_builds_them():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_parm.layout_rules import pipeline_stage_layers

    assert pipeline_stage_layers(4, 2) == [[2], [2]]
    assert pipeline_stage_layers(8, 2, 2) == [[2, 2], [2, 2]]
    assert pipeline_stage_layers(6, 3, None, 1, 1) == [[1], [4], [1]]
    assert pipeline_stage_layers(5, 2, account_for_embedding=True) == [[2], [3]]
    # Megatron-Core's own count of this stage's layers agrees with the rule
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    for kwargs, layers in ((dict(num_layers=6, num_layers_in_first_pipeline_stage=1,
                                 num_layers_in_last_pipeline_stage=1), [1, 4, 1]),
                           (dict(num_layers=5, account_for_embedding_in_pipeline_split=True),
                            None)):
        pp = 3 if layers else 2
        config = TransformerConfig(hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32,
                                   pipeline_model_parallel_size=pp, **kwargs)
        expected = layers or [stage[0] for stage in pipeline_stage_layers(
            5, 2, account_for_embedding=True)]
        assert [get_num_layers_to_build(config, pp_rank=rank) for rank in range(pp)] == expected


# Layout strings (pp, --num-layers, --mtp-num-layers): Megatron-LM's examples and its notation's
# corners; the last ones Megatron-Core 0.16.1 refuses.
LAYOUTS = [("Et*2|(tt|)*5t|tmL", 4, 16, 1), ("E|(t|)*3,m|m||L", 3, 3, None),
           ("Ettt|(tt|)*29,m|L", 32, 61, 1), ("Et|tt|t,L", 3, 4, None), ("E(t|)*2tL", 1, 3, None),
           ("Et*3mL", 1, 3, 1), ("Etttmm|L", 2, 3, 2), ("Et|t|tm|L", 2, 3, 1),
           ("Et|tm|t|L", 2, 3, 1), ("Et|tL", 2, 3, None), ("tE|tL", 2, 2, None),
           ("Et|tLm", 2, 2, 1), ("Et|t|L", 2, 2, None), ("Etm|mtL", 2, 2, 2)]


@pytest.mark.parametrize("text,pp,num_layers,mtp", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_pipeline_layout_reads_as_megatron_core_reads_it(text, pp, num_layers, mtp):
    """The stages of --pipeline-model-parallel-layout (layout_rules) are the ones Megatron-Core
    0.16.1 parses and places, and it refuses exactly the layouts Megatron-Core refuses."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)

    from megatron_parm.layout_rules import expand_pipeline_layout, pipeline_layout

    symbol = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    parsed = PipelineParallelLayerLayout.parse_str_to_list(text)
    assert expand_pipeline_layout(text) == ["".join(symbol[t.name] for t in stage)
                                            for stage in parsed]
    ours = pipeline_layout(text, pp, num_layers, mtp)
    try:
        megatron = PipelineParallelLayerLayout(text, pp)
        megatron.validate_layer_layout(num_layers, mtp)
    except (AssertionError, ValueError) as refusal:
        assert isinstance(ours, str), (ours, refusal)
        return
    assert not isinstance(ours, str), ours
    assert ours == [["".join(symbol[t.name] for t in chunk) for chunk in chunks]
                    for chunks in megatron.layout]


def test_pipeline_layout_flag():
    """--pipeline-model-parallel-layout sets the virtual stages as Megatron-LM does, and with
    --mtp-num-layers places the MTP layers where it says."""
    from megatron_parm.layout_rules import mtp_stages, pipeline_layout

    args = parse_args(PIPELINE + ["--pipeline-model-parallel-layout", "Et|(t|)*2tL"],
                      world_size=4)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert parse_args(PIPELINE + ["--pipeline-model-parallel-layout", "Ettt|tL"],
                      world_size=4).virtual_pipeline_model_parallel_size is None
    deepseek = ["--config", "configs/deepseek_v2_lite_tiny_moe.yaml", "--mtp-num-layers", "1"]
    args = parse_args(deepseek + ["--pipeline-model-parallel-size", "2",
                                  "--pipeline-model-parallel-layout", "Et|t|t|mL",
                                  "--global-batch-size", "8"], world_size=2)
    layout = pipeline_layout(args.pipeline_model_parallel_layout, 2, 3, 1)
    assert layout == [["Et", "t"], ["t", "mL"]] and mtp_stages(layout) == [1]
    assert args.virtual_pipeline_model_parallel_size == 2
    # Megatron-Core takes it, and then keeps rank 0's second embedding copy out of step
    message = error(deepseek + ["--pipeline-model-parallel-size", "2",
                                "--pipeline-model-parallel-layout", "Et||ttm|L",
                                "--global-batch-size", "8"], world_size=2)
    assert "first virtual stage" in message and "Et||ttm|L" in message


@pytest.mark.parametrize("flags,fragments", [
    (["--mtp-num-layers", "1"], ["--mtp-num-layers", "--position-embedding-type rope or none",
                                 "learned_absolute"]),
    (["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--recompute-granularity",
      "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     ["--mtp-num-layers", "--recompute-num-layers 1"]),
    (["--mtp-num-layers", "0"], ["--mtp-num-layers must be a positive integer"]),
    (["--mtp-num-layers", "1", "--position-embedding-type", "rope",
      "--overlap-moe-expert-parallel-comm", "--bf16"],
     ["--mtp-num-layers with --overlap-moe-expert-parallel-comm needs "
      "--pipeline-model-parallel-size > 1"]),
])
def test_bad_mtp_input_names_the_flags(flags, fragments):
    message = error(TINY_GPT + flags, world_size=1)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    bert = error(["--config", "configs/bert_tiny_moe.yaml", "--mtp-num-layers", "1"],
                 world_size=1, model_type="bert")
    assert "--mtp-num-layers" in bert and "BERT" in bert


@pytest.mark.parametrize("flags,fragments", [
    # layers not divisible by the stages, or by the virtual stages
    (["--num-layers", "5"], ["--num-layers (5)", "--pipeline-model-parallel-size (2)"]),
    (["--num-layers-per-virtual-pipeline-stage", "3"],
     ["--num-layers (4)", "--num-layers-per-virtual-pipeline-stage"]),
    (["--virtual-pipeline-model-parallel-size", "4"],
     ["--num-layers (4)", "virtual stages per rank (2 x 4)"]),
    (["--num-layers", "6", "--decoder-first-pipeline-num-layers", "2",
      "--pipeline-model-parallel-size", "4"], ["--decoder-first-pipeline-num-layers", "4 layers for 3 middle"]),
    # a global batch that does not give enough micro-batches
    (["--global-batch-size", "4"], ["1 micro-batch,", "--pipeline-model-parallel-size (2)",
                                    "--global-batch-size"]),
    (["--global-batch-size", "12", "--micro-batch-size", "2", "--virtual-pipeline-model-parallel-size",
      "2"], ["3 micro-batches", "multiple of --pipeline-model-parallel-size (2)"]),
    # options Megatron-Core 0.16.1 refuses with (or without) a pipeline
    (["--decoder-last-pipeline-num-layers", "2", "--account-for-loss-in-pipeline-split"],
     ["--decoder-last-pipeline-num-layers", "--account-for-loss-in-pipeline-split"]),
    (["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "2"],
     ["--pipeline-model-parallel-size > 1"]),
    (["--virtual-pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
      "1"], ["exclude each other"]),
    # --pipeline-model-parallel-layout against the model and the other split flags
    (["--pipeline-model-parallel-layout", "Ett|tL"], ["--pipeline-model-parallel-layout Ett|tL",
                                                      "3 transformer layers", "--num-layers is 4"]),
    (["--pipeline-model-parallel-layout", "Ett|tt|L"], ["3 stages", "multiple of "
                                                        "--pipeline-model-parallel-size (2)"]),
    (["--pipeline-model-parallel-layout", "Ett|ttmL"], ["1 multi-token prediction layer (m)",
                                                        "--mtp-num-layers is 0"]),
    (["--pipeline-model-parallel-layout", "Ett|tt(L"], ["a group '(...)*N' must close"]),
    (["--pipeline-model-parallel-layout", "Ett|tx*2L"], ["'x' is none of E"]),
    (["--pipeline-model-parallel-layout", "Ett|ttL", "--decoder-first-pipeline-num-layers", "2"],
     ["--pipeline-model-parallel-layout places every layer", "--decoder-first-pipeline-num-layers"]),
    (["--pipeline-model-parallel-layout", "Et|t|t|tL", "--num-layers-per-virtual-pipeline-stage",
      "1"], ["--pipeline-model-parallel-layout sets the virtual stages", "excludes"]),
    # the stages' ranks
    (["--pipeline-model-parallel-size", "3"], ["--pipeline-model-parallel-size (3) must divide"]),
    (["--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], ["--tensor-model-parallel-size (2)", "pipeline stage (4 / "]),
])
def test_bad_pipeline_input_names_the_flags(flags, fragments):
    message = error(PIPELINE + flags)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("flags,fragment", [
    (["--num-layers", "5"], "--num-layers (5) must be divisible by --pipeline-model-parallel-size"),
    (["--global-batch-size", "4"], "fewer than --pipeline-model-parallel-size (2)"),
    (["--decoder-first-pipeline-num-layers", "2", "--account-for-embedding-in-pipeline-split"],
     "Megatron-Core 0.16.1 refuses them together"),
])
def test_bad_pipeline_input_is_one_line_and_status_2(flags, fragment):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "pretrain_scripts/pretrain_gpt2_moe.py", *PIPELINE,
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "WORLD_SIZE": "4",
                               "PYTHONWARNINGS": "ignore"})
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines


# ---------------------------------------------------------------------------------------------
# today's MoE architectures
# ---------------------------------------------------------------------------------------------

MODERN = {"mixtral": "configs/mixtral_tiny_moe.yaml", "qwen3": "configs/qwen3_tiny_moe.yaml",
          "deepseek": "configs/deepseek_v2_lite_tiny_moe.yaml"}


@pytest.mark.parametrize("text,pattern", [("[0]*1+[1]*3", [0, 1, 1, 1]),
                                          ("([1]*2+[0])*2", [1, 1, 0, 1, 1, 0]),
                                          ("[1,0,1]", [1, 0, 1]), ("2", 2)])
def test_moe_layer_freq_reads_megatron_lm_list_expressions(text, pattern):
    from megatron_parm.settings import moe_layer_freq

    assert moe_layer_freq(text) == pattern


@pytest.mark.parametrize("text", ["[__import__('os')]", "[0]*x", "[0] - [1]", "[0.5]"])
def test_moe_layer_freq_evaluates_no_code(text):
    from megatron_parm.settings import moe_layer_freq

    with pytest.raises(ValueError):
        moe_layer_freq(text)


def test_modern_configs_become_megatron_core_fields():
    import torch.nn.functional as F

    from megatron_parm.training.model import build_config

    mixtral = build_config(parse_args(["--config", MODERN["mixtral"]], world_size=1))
    assert (mixtral.gated_linear_unit, mixtral.activation_func, mixtral.normalization,
            mixtral.num_query_groups, mixtral.add_bias_linear) == (True, F.silu, "RMSNorm", 2,
                                                                   False)
    qwen3 = build_config(parse_args(["--config", MODERN["qwen3"]], world_size=1))
    assert (qwen3.qk_layernorm, qwen3.kv_channels, qwen3.moe_router_topk,
            qwen3.layernorm_epsilon, qwen3.moe_router_load_balancing_type) == (
        True, 32, 8, 1e-6, "global_aux_loss")
    deepseek = build_config(parse_args(["--config", MODERN["deepseek"],
                                        "--moe-router-score-function", "sigmoid",
                                        "--moe-router-enable-expert-bias"], world_size=1))
    assert (deepseek.moe_layer_freq, deepseek.moe_shared_expert_intermediate_size,
            deepseek.moe_router_pre_softmax, deepseek.moe_router_enable_expert_bias) == (
        [0, 1, 1], 64, True, True)


def test_swiglu_ffn_default_is_megatron_lms():
    from megatron_parm.layout_rules import default_ffn_hidden_size

    assert default_ffn_hidden_size(768, swiglu=True) == 2048
    assert default_ffn_hidden_size(4096, swiglu=True) == 10880
    assert default_ffn_hidden_size(768, swiglu=False) == 3072


@pytest.mark.parametrize("flags,message", [
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups (3) must divide --num-experts (4) into equal groups"),
    (["--moe-router-num-groups", "2"], "--moe-router-num-groups and --moe-router-group-topk go"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
     "--moe-router-group-topk (3) must be at most --moe-router-num-groups (2)"),
    (["--moe-router-topk", "4", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
     "--moe-router-topk (4) must be at least --moe-router-group-topk (2) (each group is scored "
     "by its top topk / group-topk experts) and fit in the chosen groups (2 x 1 experts)"),
    (["--moe-layer-freq", "[0]+[1]*2"], "--moe-layer-freq gives 3 layers, the model has "
                                        "--num-layers 2"),
    (["--moe-layer-freq", "[0]*2"], "--moe-layer-freq makes every layer dense"),
    (["--moe-layer-freq", "[0,2]"], "--moe-layer-freq: a list holds 1 (MoE layer) or 0"),
    (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias needs "
                                          "--moe-router-score-function sigmoid"),
    (["--moe-shared-expert-gate"], "--moe-shared-expert-gate needs "
                                   "--moe-shared-expert-intermediate-size"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
])
def test_architecture_mistakes_name_the_flag(flags, message):
    assert message in error(TINY_GPT + flags, world_size=1)


def test_shared_experts_need_no_biases_and_overlap_needs_sp(tmp_path):
    with_bias = tmp_path / "with_bias.yaml"
    with_bias.write_text((REPO / "configs/gpt2_tiny_moe.yaml").read_text().replace(
        "disable_bias_linear: true", "disable_bias_linear: false"))
    assert "--moe-shared-expert-intermediate-size needs --disable-bias-linear" in error(
        ["--config", str(with_bias), "--moe-shared-expert-intermediate-size", "64"], world_size=1)
    shared = TINY_GPT + ["--moe-shared-expert-intermediate-size", "64"]
    assert parse_args(shared, world_size=1).moe_shared_expert_intermediate_size == 64
    assert "needs --sequence-parallel" in error(
        shared + ["--moe-shared-expert-overlap", "--tensor-model-parallel-size", "2",
                  "--expert-model-parallel-size", "2"])
    assert "--recompute-modules shared_experts cannot go with --moe-shared-expert-overlap" in \
        error(shared + ["--moe-shared-expert-overlap", "--recompute-granularity", "selective",
                        "--recompute-modules", "shared_experts"], world_size=1)


def test_bert_refuses_gpt_only_architecture_flags():
    bert = ["--config", str(REPO / "configs/bert_tiny_moe.yaml")]
    assert "--position-embedding-type applies to GPT models" in error(
        bert + ["--position-embedding-type", "rope"], world_size=1, model_type="bert")


def test_checkpoint_flag_rules_as_megatron_lm_checks_them():
    assert error(TINY_GPT + ["--save", "s", "--save-interval", "2", "--save-retain-interval",
                             "3"]) == ("--save-retain-interval (3) must be a multiple of "
                                       "--save-interval (2)")
    assert error(TINY_GPT + ["--save", "s", "--save-retain-interval", "4"]).startswith(
        "--save-retain-interval needs --save-interval")
    assert error(TINY_GPT + ["--non-persistent-save-interval", "3"]).startswith(
        "--non-persistent-save-interval needs --non-persistent-ckpt-type global")
    # an evaluation loads no optimizer state (Megatron-LM's rule); BERT takes the same flags
    args = parse_args(["--config", "configs/bert_tiny_moe.yaml", "--load", "x", "--skip-train",
                       "--ckpt-format", "torch", "--no-save-rng"], model_type="bert", world_size=1)
    assert args.no_load_optim and args.ckpt_format == "torch" and args.no_save_rng


FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--use-distributed-optimizer",
        "--data-parallel-sharding-strategy", "optim_grads_params"]
FSDP_LAYOUT = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
               "--sequence-parallel"]


def test_megatron_fsdp_flags_as_megatron_lm_reads_them():
    args = parse_args(TINY_GPT + FSDP_LAYOUT + FSDP + ["--moe-grouped-gemm",
                                                       "--moe-token-dispatcher-type", "parm"],
                      world_size=4)
    assert args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim_grads_params"
    from megatron_parm.training.ddp import ddp_config

    config = ddp_config(args)
    assert config.use_megatron_fsdp and config.data_parallel_sharding_strategy == \
        "optim_grads_params"
    # ZeRO-1 reduces after the backward: a pipelined schedule of SequentialMLP experts is fine
    parse_args(TINY_GPT + FSDP_LAYOUT + FSDP + ["--data-parallel-sharding-strategy", "optim",
                                                "--moe-token-dispatcher-type", "parm_s2"],
               world_size=4)


@pytest.mark.parametrize("flags, message", [
    (["--use-megatron-fsdp"], "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor "
                              "(Megatron-LM's rule), got torch_dist"),
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp"),
    (FSDP + ["--save", "s"], "--save with --use-megatron-fsdp: saving and loading "
                             "Megatron-FSDP's checkpoints (--ckpt-format fsdp_dtensor) is not "
                             "built here; drop --save"),
    (FSDP + ["--data-parallel-sharding-strategy", "no_shard"],
     "--data-parallel-sharding-strategy no_shard (its default) with --use-megatron-fsdp"),
    ([flag for flag in FSDP if flag != "--use-distributed-optimizer"],
     "--use-megatron-fsdp needs --use-distributed-optimizer here"),
    (FSDP + ["--overlap-grad-reduce"], "--overlap-grad-reduce with --use-megatron-fsdp: "
                                       "Megatron-FSDP's overlapped reductions are not built here"),
    (FSDP + ["--check-weight-hash-across-dp-replicas-interval", "2"],
     "each data-parallel rank holds a different shard of the weights"),
    (FSDP + ["--moe-token-dispatcher-type", "parm"],
     "--moe-token-dispatcher-type parm with --data-parallel-sharding-strategy "
     "optim_grads_params and SequentialMLP experts: a pipelined schedule runs the experts' "
     "backward once per chunk"),
    (["--use-torch-fsdp2"], "not available here: --use-torch-fsdp2: torch FSDP2 is not built "
                            "here"),
])
def test_megatron_fsdp_rules_name_the_flag(flags, message):
    assert message in error(TINY_GPT + FSDP_LAYOUT + flags)


# ---------------------------------------------------------------------------------------------
# run control (training/run_control.py): Megatron-LM's rules between its flags
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--error-injection-rate", "10", "--rerun-mode", "disabled"],
     "--error-injection-rate 10 injects errors only with --rerun-mode validate_results (not "
     "disabled)"),
    (["--calculate-per-token-loss", "--ddp-average-in-collective"],
     "--calculate-per-token-loss with --ddp-average-in-collective: the per-token loss sums the "
     "gradients over data-parallel ranks (Megatron-Core refuses the average)"),
    (["--deterministic-mode", "--cross-entropy-loss-fusion"],
     "--deterministic-mode with --cross-entropy-loss-fusion: Megatron-LM refuses it (that kernel "
     "is not deterministic)"),
    (["--exit-signal", "SIGKILL"],
     "--exit-signal SIGKILL: no process can catch SIGKILL (pick another signal, e.g. SIGTERM or "
     "SIGUSR1)"),
    (["--rerun-mode", "report_stats"],
     "not available here: --rerun-mode report_stats: Megatron-LM core_v0.16.1 cannot run it "
     "either: it is no mode of Megatron-Core 0.16.1's rerun engine (report_determinism_stats "
     "there), whose report of the statistics fails (its Caller has no filename)"),
])
def test_run_control_rules_name_the_flag(flags, message):
    assert error(TINY_GPT + flags, world_size=1) == message


def test_run_control_flags_as_megatron_lm_reads_them(tmp_path):
    args = parse_args(TINY_GPT, world_size=1)
    assert args.check_for_nan_in_loss_and_grad and args.rerun_mode == "validate_results"
    assert (args.exit_signal, args.iterations_to_skip, args.manual_gc_eval) == ("SIGTERM", [], True)
    # --recompute-activations: Megatron-LM's older spelling of selective recompute
    args = parse_args(TINY_GPT + ["--recompute-activations"], world_size=1)
    assert args.recompute_granularity == "selective"
    # fp16's dynamic loss scaling lowers the scale on a NaN: Megatron-LM turns the check off
    assert not parse_args(TINY_GPT + ["--fp16"], world_size=1).check_for_nan_in_loss_and_grad
    assert parse_args(TINY_GPT + ["--fp16", "--loss-scale", "1024"],
                      world_size=1).check_for_nan_in_loss_and_grad
    config = tmp_path / "run.yaml"
    config.write_text((REPO / "configs/gpt2_tiny_moe.yaml").read_text()
                      + "exit_signal: SIGUSR1\nno_check_for_nan_in_loss_and_grad: true\n"
                        "iterations_to_skip: [3, 1]\nno_manual_gc_eval: true\n")
    args = parse_args(["--config", str(config)], world_size=1)
    assert (args.exit_signal, args.check_for_nan_in_loss_and_grad, args.manual_gc_eval) == \
        ("SIGUSR1", False, False)
    assert args.iterations_to_skip == [3, 1]


def test_rejected_results_file_adds_iterations_to_skip(tmp_path):
    """Megatron-LM's rule (RerunStateMachine.get_skipped_iterations_from_tracker_file): an
    iteration rejected twice on the same rank, and reproduced, is skipped; one rejected on
    several ranks of one job is not."""
    tracker = tmp_path / "rejected.txt"
    line = ("ts=2026-01-01 00:00:00 node=n device=0 jobID={job} rank={rank} iteration={it} "
            "status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE result=nan message='x'\n")
    tracker.write_text(line.format(job=1, rank=0, it=7) + line.format(job=2, rank=0, it=7)
                       + line.format(job=1, rank=0, it=9) + line.format(job=3, rank=0, it=11)
                       + line.format(job=3, rank=1, it=11) + line.format(job=4, rank=0, it=11))
    args = parse_args(TINY_GPT + ["--result-rejected-tracker-filename", str(tracker),
                                  "--iterations-to-skip", "2"], world_size=1)
    assert args.iterations_to_skip == [2, 7]
    # the parser's default list is not changed by it
    assert parse_args(TINY_GPT, world_size=1).iterations_to_skip == []
