"""Pipeline parallelism (--pipeline-model-parallel-size) in training and checkpoints, on gloo.

Two torchrun launches (this file run as a script), 4 ranks then 8, each paying its world size
once. The model is the tiny GPT-2 MoE with 4 layers (no dropout). Every run starts from the
same weights: the first run trains one iteration without pipelining and saves (`start`); the
others load it (a checkpoint loads in any layout) and train iterations 2-11 of the same
11-iteration schedule.

4 ranks:
  * reference: pp=1 (tp=2, ep=2, etp=1, sequence parallel), alltoall;
  * pp=2 (the same tp, ep, etp): alltoall for 10 iterations (saving at 5 and 10), every other
    dispatcher for 5;
  * pp=2 with activation recompute, full (uniform, one layer) and selective (`moe core_attn
    layernorm`), with alltoall, parm_s2 (pipelined) and parm, iterations 2-4 each;
  * pp=2 interleaved (2 virtual stages of one layer), alltoall; and with
    --microbatch-group-size-per-virtual-pipeline-stage 4, iterations 2-4;
  * pp=2 resumed from its own iteration-5 checkpoint (the same layout);
  * that checkpoint loaded at pp=1 and at pp=4 (tp=1, ep=1), one iteration each;
  * multi-token prediction (--mtp-num-layers 1, rope) from its own pp=1 start: at pp=1, at
    pp=2 by --pipeline-model-parallel-layout Et|t|tt|mL with parm, at pp=4 by Et|tt|tm|L (the
    MTP layer a stage of its own, saving at iteration 2), iterations 2-4; the pp=4 one resumed
    from its iteration-2 checkpoint;
  * BERT MoE (its tiny config, 2 layers: one a stage) from its own one-iteration pp=1 start,
    at pp=1 and at pp=2 with parm, iterations 2-6.
8 ranks:
  * pp=2 with tp=2, ep=2 (etp=1), alltoall; the same in Megatron-Core's other rank order
    (--use-tp-pp-dp-mapping) with parm_s2, iterations 2-6;
  * the pp=2 checkpoint loaded at pp=1 (tp=2, ep=4, etp=2) and at pp=4 (tp=2, ep=1), one
    iteration each.
The tests then check that the pipelined losses (GPT's, BERT's, MTP's) follow the reference (1e-4,
as the dispatchers follow alltoall in test_pretrain.py), that recompute leaves a dispatcher's
pipelined losses as they are without it (1e-6; parm, which tunes, 1e-4) while each step routes
again once per layer and micro-batch, that a same-layout resume repeats them bitwise (with MTP
too), that a checkpoint saved at pp=2 gives the same next loss at pp=1 and pp=4 (1e-6), and
that the converter and the inspector read pipelined checkpoints.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

MODEL = ["--config", "configs/gpt2_tiny_moe.yaml", "--num-layers", "4",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "11",
         "--lr-warmup-iters", "2", "--log-interval", "5", "--eval-iters", "0"]
SP = ["--sequence-parallel"]
REFERENCE = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
             "--expert-tensor-parallel-size", "1"] + SP
PP2 = REFERENCE + ["--pipeline-model-parallel-size", "2"]
# parm's tuning decides inside the 5 iterations' 20 calls per layer (4 micro-batches each): at
# most 6 candidates (the default shortlist of 5 and the one always timed) x (1 warm-up + 2 timed)
# calls (tuning.most_calls).
PARM_DECIDES = ["--parm-tune-steps", "2"]
BERT = ["--config", "configs/bert_tiny_moe.yaml"] + MODEL[2:]
CURVE_TOLERANCE = 1e-4  # relative, as the dispatchers meet against alltoall
LOAD_TOLERANCE = 1e-6  # relative: the same weights in another layout, one iteration
# Megatron-LM's activation-recompute flags (as tests/e2e/test_pretrain.py runs them at pp=1),
# each with these dispatchers at pp=2, iterations 2-4
RECOMPUTE = {"full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"],
             "selective": ["--recompute-granularity", "selective", "--recompute-modules", "moe",
                           "core_attn", "layernorm"]}
RECOMPUTE_DISPATCHERS = ("alltoall", "parm_s2", "parm")
RECOMPUTE_ITERS = ["--exit-interval", "4"]
MTP = ["--position-embedding-type", "rope", "--mtp-num-layers", "1"]
LAYOUT = "--pipeline-model-parallel-layout"
MTP_RUNS = [("pp1", REFERENCE, "alltoall"),
            ("pp2 Et|t|tt|mL parm", PP2 + [LAYOUT, "Et|t|tt|mL"] + PARM_DECIDES, "parm"),
            ("pp4 Et|tt|tm|L", ["--pipeline-model-parallel-size", "4", LAYOUT, "Et|tt|tm|L"],
             "alltoall")]
MTP_SAVED = "mtp_pp4"  # the pp4 run saves here at iteration 2; a run resumes from it


def dispatchers():
    from megatron_parm import schedules

    return [name for name in schedules.names() if name != "allgather"]


def worker(world: str, run_dir: str) -> None:
    """Every rank runs this under torchrun; rank 0 writes RUN_DIR/results_<world>.json."""
    sys.path.insert(0, str(REPO))
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    run = Path(run_dir)
    start = str(run / "start")
    routed = [0]  # the routers' forward calls on this rank (its stage's MoE layers)
    route = TopKRouter.forward

    def counted(self, *args, **kwargs):
        routed[0] += 1
        return route(self, *args, **kwargs)

    TopKRouter.forward = counted

    def train(*flags, dispatcher="alltoall", model="gpt"):
        args = parse_args((MODEL if model == "gpt" else BERT) + list(flags)
                          + ["--moe-token-dispatcher-type", dispatcher], model_type=model)
        began, routed[0] = time.time(), 0
        summary = pretrain(args)
        return {"losses": summary["losses"], "grad_norms": summary["grad_norms"],
                "seconds": time.time() - began,
                "forwards": routed[0]}

    results = {}
    if world == "4":
        train(*REFERENCE, "--save", start, "--exit-interval", "1")
        results["reference"] = train(*REFERENCE, "--load", start)
        saved = str(run / "pp2")
        results["pp2"] = {"alltoall": train(*PP2, "--load", start, "--save", saved,
                                            "--save-interval", "5")}
        for name in dispatchers():
            if name != "alltoall":
                results["pp2"][name] = train(*PP2, "--load", start, "--exit-interval", "6",
                                             *(PARM_DECIDES if name == "parm" else ()),
                                             dispatcher=name)
        results["recompute"] = {
            f"{kind} {name}": train(*PP2, *flags, "--load", start, *RECOMPUTE_ITERS,
                                    dispatcher=name)
            for kind, flags in RECOMPUTE.items() for name in RECOMPUTE_DISPATCHERS}
        results["interleaved"] = train(*PP2, "--num-layers-per-virtual-pipeline-stage", "1",
                                       "--load", start)
        # the 4 micro-batches as one group per virtual stage (breadth first), iterations 2-4
        results["interleaved_group_4"] = train(
            *PP2, "--num-layers-per-virtual-pipeline-stage", "1",
            "--microbatch-group-size-per-virtual-pipeline-stage", "4", "--load", start,
            "--exit-interval", "4")
        iter5 = f"{saved}/iter_0000005"
        results["resumed"] = train(*PP2, "--load", iter5)
        results["at_pp1"] = train(*REFERENCE, "--load", iter5, "--exit-interval", "6")
        results["at_pp4"] = train("--pipeline-model-parallel-size", "4", "--load", iter5,
                                  "--exit-interval", "6")
        # multi-token prediction (rope positions, as Megatron-LM asks) from its own pp=1 start:
        # at pp=1; at pp=2 by a layout (2 virtual stages, the MTP layer with the last
        # transformer layers) with parm; at pp=4 with the MTP layer in a stage of its own
        mtp_start = str(run / "mtp_start")
        train(*REFERENCE, *MTP, "--save", mtp_start, "--exit-interval", "1")
        mtp_saved = str(run / MTP_SAVED)
        results["mtp"] = {name: train(*flags, *MTP, "--load", mtp_start, "--exit-interval", "4",
                                      *(("--save", mtp_saved, "--save-interval", "2")
                                        if name.startswith("pp4") else ()),
                                      dispatcher=dispatcher)
                          for name, flags, dispatcher in MTP_RUNS}
        results["mtp"]["pp4 resumed"] = train(*MTP_RUNS[-1][1], *MTP, "--load",
                                              f"{mtp_saved}/iter_0000002", "--exit-interval", "4")
        bert_start = str(run / "bert_start")
        train(*REFERENCE, "--save", bert_start, "--exit-interval", "1", model="bert")
        results["bert_reference"] = train(*REFERENCE, "--load", bert_start, "--exit-interval",
                                          "6", model="bert")
        results["bert_pp2"] = train(*PP2, "--load", bert_start, "--exit-interval", "6",
                                    dispatcher="parm", model="bert")
    else:
        results["pp2_tp2_ep2"] = train(*PP2, "--load", start)
        # Megatron-Core's other rank order: the stages are no longer consecutive ranks
        results["tp_pp_dp"] = train(*PP2, "--use-tp-pp-dp-mapping", "--load", start,
                                    "--exit-interval", "6", dispatcher="parm_s2")
        results["tp_pp_dp"]["pp_group"] = torch.distributed.get_process_group_ranks(
            parallel_state.get_pipeline_model_parallel_group())
        iter5 = str(run / "pp2" / "iter_0000005")
        results["at_pp1_ep4_etp2"] = train(
            "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4",
            "--expert-tensor-parallel-size", "2", *SP, "--load", iter5, "--exit-interval", "6")
        results["at_pp4_tp2"] = train(
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4", *SP,
            "--load", iter5, "--exit-interval", "6")
    if torch.distributed.get_rank() == 0:
        (run / f"results_{world}.json").write_text(json.dumps(results))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared_data):
    from launch import torchrun

    run_dir = tmp_path_factory.mktemp("pipeline")
    results, outputs, seconds = {}, {}, {}
    for world in ("4", "8"):
        began = time.time()
        proc = torchrun(str(Path(__file__).relative_to(REPO)), int(world), f"worker{world}",
                        str(run_dir))
        seconds[world] = time.time() - began
        results.update(json.loads((run_dir / f"results_{world}.json").read_text()))
        outputs[world] = proc.stdout
    print(f"pipeline launches: 4 ranks {seconds['4']:.0f} s, 8 ranks {seconds['8']:.0f} s")
    return results, outputs, run_dir


def _close(losses, reference, tolerance):
    assert len(losses) == len(reference) >= 1, (losses, reference)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    assert worst <= tolerance, (worst, losses, reference)


def test_pipelined_run_matches_the_unpipelined_model(runs):
    results, outputs, _ = runs
    reference = results["reference"]["losses"]
    assert len(reference) == 10 and reference[-1] < reference[0], reference
    _close(results["pp2"]["alltoall"]["losses"], reference, CURVE_TOLERANCE)
    _close(results["interleaved"]["losses"], reference, CURVE_TOLERANCE)
    # another order of the same micro-batches: the same steps
    _close(results["interleaved_group_4"]["losses"], results["interleaved"]["losses"][:3], 1e-5)
    _close(results["pp2_tp2_ep2"]["losses"], reference, CURVE_TOLERANCE)
    assert "pp=2, dp=1" in outputs["4"] and "pp=2 x 2 virtual" in outputs["4"]
    assert "pp=2, dp=2" in outputs["8"]


def test_bert_pipelined_matches_the_unpipelined_model(runs):
    results, outputs, _ = runs
    reference = results["bert_reference"]["losses"]
    assert len(reference) == 5, reference
    _close(results["bert_pp2"]["losses"], reference, CURVE_TOLERANCE)
    assert "sop loss" in outputs["4"]


def test_every_dispatcher_follows_alltoall_under_pipelining(runs):
    results, _, _ = runs
    alltoall = results["pp2"]["alltoall"]["losses"]
    assert set(results["pp2"]) == set(dispatchers())
    for name, run in results["pp2"].items():
        _close(run["losses"], alltoall[:len(run["losses"])], CURVE_TOLERANCE)
        assert len(run["losses"]) >= 5, name


def test_activation_recompute_under_pipelining_leaves_the_losses(runs):
    """Full and selective recompute at pp=2: each dispatcher's losses are those of its run
    without recompute (1e-6, fp32; parm within 1e-4, as it tunes), and every step routes again
    once per layer of the stage and micro-batch (rank 0: stage 0's 2 layers, 4 micro-batches)."""
    results, _, _ = runs
    plain, recomputed = results["pp2"], results["recompute"]
    assert set(recomputed) == {f"{kind} {name}" for kind in RECOMPUTE
                               for name in RECOMPUTE_DISPATCHERS}

    def per_iteration(run):
        return run["forwards"] / len(run["losses"])

    for case, run in recomputed.items():
        reference = plain[case.split()[1]]
        assert len(run["losses"]) == 3, (case, run)
        tolerance = 1e-4 if case.endswith("parm") else 1e-6
        assert run["losses"] == pytest.approx(reference["losses"][:3], abs=tolerance), case
        assert per_iteration(run) - per_iteration(reference) == 2 * 4, (case, run, reference)


def test_parm_chooses_per_layer_on_each_stage(runs):
    _, outputs, _ = runs
    # Each stage's first rank reports its own layers' choices: all four layers are there.
    for layer in range(1, 5):
        assert f"> MoE layer {layer}: parm chose" in outputs["4"], layer


def test_multi_token_prediction_under_pipeline_layouts(runs):
    """--mtp-num-layers with --pipeline-model-parallel-layout: the MTP layer built with the
    last transformer layers (parm dispatching in it, tp=2, ep=2) and in a stage of its own
    (Megatron-Core's mtp_standalone: its copy of the word embeddings, the shapes sent first)
    load the pp=1 start and train as the pp=1 run does (the MTP loss joins every gradient)."""
    results = runs[0]["mtp"]
    for name in ("pp2 Et|t|tt|mL parm", "pp4 Et|tt|tm|L"):
        _close(results[name]["losses"], results["pp1"]["losses"], CURVE_TOLERANCE)


def test_resume_at_the_same_pipeline_layout_is_bitwise(runs):
    results, outputs, _ = runs
    uninterrupted = results["pp2"]["alltoall"]["losses"]  # iterations 2-11
    assert results["resumed"]["losses"] == uninterrupted[4:]  # iterations 6-11
    assert "RNG states restored" in outputs["4"]


def test_resume_with_multi_token_prediction_is_bitwise(runs):
    """The pp=4 MTP run (the MTP layer in a stage of its own) resumed from its iteration-2
    checkpoint repeats iterations 3-4: the LM losses, and the gradient norms, to which the MTP
    layer's own weights and loss contribute."""
    results = runs[0]["mtp"]
    uninterrupted, resumed = results["pp4 Et|tt|tm|L"], results["pp4 resumed"]
    assert resumed["losses"] == uninterrupted["losses"][1:]  # iterations 3-4
    assert resumed["grad_norms"] == uninterrupted["grad_norms"][1:]


def test_tp_pp_dp_rank_order_trains_as_the_default_one(runs):
    """--use-tp-pp-dp-mapping at pp=2 on 8 ranks (tp=2, ep=2): Megatron-Core's groups in that
    order (rank 0's pipeline group strides by tp), and parm_s2 follows alltoall's losses in
    the default order."""
    results = runs[0]
    assert results["tp_pp_dp"]["pp_group"] == [0, 2]  # [0, 4] in the default order
    _close(results["tp_pp_dp"]["losses"], results["pp2_tp2_ep2"]["losses"][:5], CURVE_TOLERANCE)


def test_checkpoint_saved_at_pp2_loads_at_pp1_and_pp4(runs):
    results, outputs, _ = runs
    next_loss = results["pp2"]["alltoall"]["losses"][4:5]  # iteration 6
    for name in ("at_pp1", "at_pp4", "at_pp1_ep4_etp2", "at_pp4_tp2"):
        _close(results[name]["losses"], next_loss, LOAD_TOLERANCE)
    assert "saved in another layout (4 ranks, tp=2 ep=2 etp=1 pp=2" in outputs["4"]


def test_tools_read_pipelined_checkpoints(runs, tmp_path):
    _, _, run_dir = runs
    from launch import convert_checkpoint

    source = run_dir / "pp2"
    shown = subprocess.run([sys.executable, "tools/inspect_checkpoint.py", str(source)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "pp=2" in shown.stdout
    # pp=2 -> pp=1 (one file and back, and a resharding), bitwise in every tensor
    single = tmp_path / "ckpt.pt"
    for args in (["--load", source / "iter_0000005", "--to-single-file", single],
                 ["--from-single-file", single, "--save", tmp_path / "back"],
                 ["--load", source / "iter_0000005", "--save", tmp_path / "pp1",
                  "--target-pipeline-parallel-size", "1"]):
        proc = convert_checkpoint(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]

    def crcs(path):
        proc = subprocess.run([sys.executable, "tools/inspect_checkpoint.py", str(path),
                               "--verify", "--no-tensors"], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return sorted(line.strip() for line in proc.stdout.splitlines()
                      if line.strip().startswith("crc32 "))

    original = crcs(source / "iter_0000005")
    assert original and crcs(tmp_path / "back") == original == crcs(tmp_path / "pp1")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("worker4", "worker8"):
        sys.exit("usage: torchrun --nproc-per-node {4,8} tests/e2e/test_pipeline.py "
                 "worker{4,8} RUN_DIR")
    worker(sys.argv[1][len("worker"):], sys.argv[2])
