"""tools/megatron_lm_configs.py: a Megatron-LM functional-test configuration (written here in
its format, not copied) becomes a command line of this machine with only paths and sizes
changed, which the training parser reads."""

from __future__ import annotations

import json

import pytest

from launch import REPO, load_tool
from megatron_parm import settings

CONFIG = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
MODEL_ARGS:
  --num-layers: 16
  --hidden-size: 1024
  --num-attention-heads: 16
  --group-query-attention: true
  --num-query-groups: 8
  --log-params-norm: true
  --tensorboard-dir: ${TENSORBOARD_PATH}
  --micro-batch-size: 4
  --global-batch-size: 256
  --seq-length: 4096
  --train-samples: 100000
  --lr-decay-samples: 90000
  --lr-warmup-samples: 1000
  --save: ${CHECKPOINT_SAVE_PATH}
  --data-path: ${DATA_PATH}/my-gpt3_00_text_document
  --vocab-file: ${DATA_PATH}/bpe/vocab.json
  --merge-file: ${DATA_PATH}/bpe/merges.txt
  --lr: 3.0e-4
  --tensor-model-parallel-size: 4
  --pipeline-model-parallel-size: 4
  --expert-model-parallel-size: 16
  --expert-tensor-parallel-size: 1
  --num-experts: 64
  --moe-layer-freq: ([0]*2+[1]*14)
  --moe-router-topk: 8
  --moe-token-dispatcher-type: flex
  --no-rope-fusion: true
  --bf16: false
TEST_TYPE: regular
"""

INFERENCE = "MODE: inference\nMODEL_ARGS:\n  --num-layers: 2\n"

SCRIPT = """\
#!/bin/bash
GPUS_PER_NODE=8
DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes 1
)
MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096   # the width
    --swiglu
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
)
torchrun ${DISTRIBUTED_ARGS[@]} ${MODEL_ARGS[@]} ${MOE_ARGS[@]}
"""


@pytest.fixture(scope="module")
def tool():
    return load_tool("megatron_lm_configs")


@pytest.fixture
def checkout(tmp_path):
    cases = tmp_path / "tests" / "functional_tests" / "test_cases"
    (cases / "moe" / "big_fine_grained").mkdir(parents=True)
    (cases / "moe" / "big_fine_grained" / "model_config.yaml").write_text(CONFIG)
    (cases / "moe" / "inference_case").mkdir(parents=True)
    (cases / "moe" / "inference_case" / "model_config.yaml").write_text(INFERENCE)
    (tmp_path / "examples" / "mixtral").mkdir(parents=True)
    (tmp_path / "examples" / "mixtral" / "train_mixtral_8x7b_distributed.sh").write_text(SCRIPT)
    return tmp_path


def test_only_paths_sizes_and_the_dispatcher_change(tool, checkout, tmp_path):
    found = tool.configurations(str(checkout))
    assert list(found) == ["big_fine_grained", "examples_mixtral_8x7b"]  # no inference case
    argv, ranks = tool.adapt("big_fine_grained", found["big_fine_grained"], str(tmp_path / "w"))
    given = {flag for flag, value in found["big_fine_grained"] if value is not False}
    named = {word for word in argv if word.startswith("--")}
    # every flag of the config stays but the tokenizer's files; the tokenizer and the
    # parallel sizes are the only additions
    assert given - named == {"--vocab-file", "--merge-file"}
    assert named - given == {"--tokenizer-type", "--tokenizer-model", "--log-interval"}
    value = dict(zip(argv, argv[1:]))
    # 16 layers: the --moe-layer-freq pattern names them all; 8 ranks at most
    assert value["--num-layers"] == "16" and ranks == 8
    assert (value["--tensor-model-parallel-size"], value["--pipeline-model-parallel-size"],
            value["--expert-model-parallel-size"], value["--expert-tensor-parallel-size"]) == (
                "2", "2", "4", "1")
    assert value["--moe-token-dispatcher-type"] == "parm" and value["--num-experts"] == "64"
    assert value["--train-samples"] == str(20 * int(value["--global-batch-size"]))
    assert value["--data-path"] == tool.DATA_PATH and value["--save"].startswith(str(tmp_path))
    assert tool.own_dispatcher(found["big_fine_grained"]) == "alltoall"  # flex computes it
    # the training parser takes it as it is (what it refuses is the run's first line)
    args = settings.training_parser().parse_args(argv)
    assert args.num_experts == 64 and args.moe_layer_freq == [0, 0] + [1] * 14


def test_multi_latent_attention_s_sizes_are_cut_where_given(tool, checkout, tmp_path):
    pairs = tool.configurations(str(checkout))["big_fine_grained"] + [
        ("--multi-latent-attention", True), ("--q-lora-rank", 1536), ("--kv-lora-rank", 512),
        ("--qk-head-dim", 128), ("--qk-pos-emb-head-dim", 64), ("--v-head-dim", 128)]
    argv, _ = tool.adapt("mla", pairs, str(tmp_path / "w"))
    value = dict(zip(argv, argv[1:]))
    assert {flag: value[flag] for flag in tool.MLA_SIZES} == {
        flag: str(size) for flag, size in tool.MLA_SIZES.items()}
    assert "--q-lora-rank" not in tool.adapt("plain", pairs[:-6], str(tmp_path / "w"))[0]


def test_fewer_iterations_scale_the_schedule_and_the_report_says_so(tool, checkout, tmp_path):
    pairs = tool.configurations(str(checkout))["big_fine_grained"]
    argv, _ = tool.adapt("big", pairs, str(tmp_path / "w"), iterations=6)
    value = dict(zip(argv, argv[1:]))
    batch = int(value["--global-batch-size"])
    assert (value["--train-samples"], value["--lr-decay-samples"]) == (str(6 * batch),) * 2
    retained = tool.adapt("big", pairs + [("--save-interval", 100), ("--save-retain-interval",
                                                                      2500)], "w", 6)[0]
    value = dict(zip(retained, retained[1:]))
    assert (value["--save-interval"], value["--save-retain-interval"]) == ("3", "6")
    record = {"name": "big", "first": {"status": 0, "refused": []}, "iterations": 6,
              "largest_difference": 1e-6, "losses_follow": True}
    assert "| 1.00e-06 (6 iterations) | losses follow |" in tool.report([record], "M")
    with pytest.raises(ValueError, match="--iterations 1"):
        tool.main(["--megatron-lm", str(checkout), "--iterations", "1"])


def test_a_launch_script_s_arrays_are_read(tool, checkout):
    pairs = tool.read_script(str(checkout / tool.EXAMPLE))
    assert pairs == [("--num-layers", "32"), ("--hidden-size", "4096"), ("--swiglu", True),
                     ("--num-experts", "8"), ("--moe-router-topk", "2")]
    assert tool.own_dispatcher(pairs) == "allgather"  # Megatron-LM's default


def test_context_parallelism_runs_over_all_gather(tool, checkout, tmp_path):
    """A configuration with --context-parallel-size runs it over all_gather (p2p, Megatron-LM's
    default, needs Transformer Engine's attention), its world counting cp."""
    pairs = tool.configurations(str(checkout))["big_fine_grained"]
    argv, ranks = tool.adapt("cp", [*pairs, ("--context-parallel-size", "2")],
                             str(tmp_path / "w"))
    value = dict(zip(argv, argv[1:]))
    assert value["--context-parallel-size"] == "2" and value["--cp-comm-type"] == "all_gather"
    assert ranks % (2 * int(value["--tensor-model-parallel-size"])) == 0


def test_the_refusal_line_and_the_loss_comparison(tool):
    stderr = ("warning: x\nerror: not available here: --context-parallel-size 2: context "
              "parallelism is not built yet (the next issue); --fp8-format hybrid: FP8 / FP4 "
              "training needs Transformer Engine on a Hopper or newer GPU\n")
    refused = tool.refused_flags(stderr)
    assert [flag for flag, _ in refused] == ["--context-parallel-size", "--fp8-format"]
    assert [tool.needs_gpu_or_te(reason) for _, reason in refused] == [False, True]
    assert tool.without(["--a", "1", "--fp8-format", "hybrid", "--b"], ["--fp8-format"]) == [
        "--a", "1", "--b"]
    assert tool.compare([1.0, 2.0], [1.0, 2.00005], bf16=False) == (pytest.approx(5e-5), True)
    assert tool.compare([1.0, 2.0], [1.0, 2.001], bf16=False)[1] is False
    assert tool.compare([1.0], [1.0, 2.0], bf16=False)[1] is False
    assert tool.compare([10.0], [10.05], bf16=True)[1] is True


def test_the_layout_leaves_every_optimizer_instance_a_data_parallel_group(tool):
    """Megatron-Core splits the dense and the expert data-parallel groups into
    --num-distributed-optimizer-instances parts: at tp 2, ep 2 that takes 8 ranks, not 4."""
    flags = {"--tensor-model-parallel-size": "2", "--expert-model-parallel-size": "2"}
    assert tool._layout(flags)["world"] == 4
    layout = tool._layout({**flags, "--num-distributed-optimizer-instances": "2"})
    assert (layout["world"], layout["dp"]) == (8, 4)
    with pytest.raises(ValueError, match="--num-distributed-optimizer-instances 16"):
        tool._layout({**flags, "--num-distributed-optimizer-instances": "16"})


def test_the_layout_keeps_megatron_core_s_rule_of_the_tp_pp_dp_order(tool):
    """With --use-tp-pp-dp-mapping and pipelining, Megatron-Core needs ep x etp = tp x cp: the
    tp 4 of a config cut to 2 takes etp 1 (its ep kept); without the order, etp stays."""
    flags = {"--tensor-model-parallel-size": "4", "--pipeline-model-parallel-size": "2",
             "--expert-model-parallel-size": "2", "--expert-tensor-parallel-size": "2"}
    assert tool._layout(flags)["etp"] == 2
    layout = tool._layout({**flags, "--use-tp-pp-dp-mapping": True})
    assert (layout["tp"], layout["ep"], layout["etp"]) == (2, 2, 1)


def test_a_split_that_leaves_a_part_empty_on_the_corpus_is_widened(tool):
    assert tool._split("99990,8,2") == "98,1,1"  # examples/mixtral's
    assert tool._split("949,50,1") == "949,50,1"


def test_a_bracketed_value_is_its_words_as_megatron_lm_s_runner_passes_it(tool):
    assert tool._words("[layernorm mla_up_proj mlp moe_act]") == [
        "layernorm", "mla_up_proj", "mlp", "moe_act"]
    assert tool._words("([0]*1+[1]*15)") == ["([0]*1+[1]*15)"]  # one word, as the runner quotes
    assert tool._words("0.5 0.5") == ["0.5 0.5"] and tool._words(3) == ["3"]
    # a YAML plain scalar keeps its backslashes; xargs and the shell's eval each read them once
    assert tool._words(r"Et*2\\|\\(tt\\|\\)*5t\\|tmL") == ["Et*2|(tt|)*5t|tmL"]


def test_the_report_takes_each_configuration_s_newest_record_and_says_what_stopped_it(
        tool, tmp_path):
    refused = {"status": 2, "losses": [], "tail": ["error: not available here: ..."],
               "refused": [["--use-megatron-fsdp", "FSDP is not built here"]]}
    failed = {"status": 2, "losses": [], "refused": [], "tail": ["x", "error: --a: wrong"]}
    records = [{"name": "b", "first": refused, "gpu_or_te_only": False},
               {"name": "a", "first": {**refused, "refused": [["--transformer-impl",
                                                               "needs Transformer Engine"]]},
                "gpu_or_te_only": True, "without_refused": failed},
               {"name": "b", "first": {**failed, "status": 0, "tail": []},
                "losses_follow": True, "largest_difference": 1e-6}]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    newest = tool.newest_records(str(path), ["a", "b", "c"])
    assert [record["name"] for record in newest] == ["a", "b"] and newest[1]["losses_follow"]
    assert tool.stop_reason(newest[0]) == "error: --a: wrong"
    assert tool.stop_reason(records[0]) == "--use-megatron-fsdp: FSDP is not built here"
    assert tool.stop_reason(newest[1]) == ""
