"""Hugging Face GPT-2 -> our checkpoints: dense import and upcycling to MoE.

A tiny random GPT-2 is written as Hugging Face saves it (config.json + model.safetensors, and a
pytorch_model.bin copy). tools/convert_checkpoint.py imports it dense (--from-hf) and upcycles
it to 4 experts (--upcycle --load DIR). One 4-rank launch (this file as a script) then loads
each into Megatron's GPT and records per-token losses on one fixed batch, for the dense model
(tp=2) and the MoE in several layouts and dispatchers (biases on, so ETP = 1), plus the
trainer's evaluation loss of both. The tests compare them with a plain GPT-2 computed from the
Hugging Face weights (tests/reference_gpt2.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from launch import convert_all, convert_checkpoint as convert, torchrun  # noqa: E402
from reference_gpt2 import gpt2_logits, random_gpt2, write_hf_gpt2  # noqa: E402

HF_CONFIG = {"vocab_size": 8000, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4,
             "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
BATCH, SEQ = 2, 64
# (name, (tp, ep, etp), dispatcher); the dense model first.
LAYOUTS = [("dense", (2, 1, 2), "alltoall"), ("moe 1,1,1 alltoall", (1, 1, 1), "alltoall"),
           ("moe 2,2,1 alltoall", (2, 2, 1), "alltoall"), ("moe 2,2,1 parm", (2, 2, 1), "parm"),
           ("moe 1,4,1 parm_s2", (1, 4, 1), "parm_s2")]


def fixed_batch():
    tokens = torch.randint(0, HF_CONFIG["vocab_size"], (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1], tokens[:, 1:]


def write_configs(run: Path) -> None:
    """The tiny GPT config with GPT-2's biases and activation, dense and MoE."""
    values = yaml.safe_load((REPO / "configs/gpt2_tiny_moe.yaml").read_text())
    values.update(disable_bias_linear=False, openai_gelu=True, eval_iters=2)
    (run / "moe.yaml").write_text(yaml.safe_dump(values))
    for key in ("num_experts", "moe_router_topk", "moe_aux_loss_coeff"):
        values.pop(key)
    (run / "dense.yaml").write_text(yaml.safe_dump(values))


def layout_flags(name, tp, ep, etp, dispatcher, run: Path):
    kind = "dense" if name == "dense" else "moe"
    flags = ["--config", str(run / f"{kind}.yaml"), "--load", str(run / f"hf_{kind}"),
             "--tensor-model-parallel-size", str(tp), "--moe-token-dispatcher-type", dispatcher]
    if kind == "moe":
        flags += ["--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp)]
    return flags + (["--sequence-parallel"] if tp > 1 else [])


def worker(run_dir: str) -> None:
    sys.path.insert(0, str(REPO))
    from megatron_parm.checkpointing import find_checkpoint, load_checkpoint, read_checkpoint_info
    from megatron_parm.parallel import initialize_model_parallel
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.model import build_model
    from megatron_parm.training.trainer import initialize_distributed, pretrain, set_seed

    initialize_distributed()
    run = Path(run_dir)
    tokens, labels = fixed_batch()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    masked = ~torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    results = {"losses": {}, "eval": {}}
    for name, (tp, ep, etp), dispatcher in LAYOUTS:
        args = parse_args(layout_flags(name, tp, ep, etp, dispatcher, run))
        initialize_model_parallel(tp, args.expert_model_parallel_size,
                                  args.expert_tensor_parallel_size, args.num_experts, dispatcher)
        set_seed(args.seed)
        folder = find_checkpoint(args.load).path
        padded = read_checkpoint_info(folder)["model_info"]["padded_vocab_size"]
        model = build_model(args, HF_CONFIG["vocab_size"], padded)
        load_checkpoint(folder, model, None, None, args)
        model.eval()
        with torch.no_grad():
            losses_bs = model(tokens, positions, masked.expand(BATCH, 1, SEQ, SEQ), labels=labels)
        results["losses"][name] = losses_bs.tolist()
    for name, (tp, ep, etp), dispatcher in (LAYOUTS[0], LAYOUTS[3]):
        summary = pretrain(parse_args(layout_flags(name, tp, ep, etp, dispatcher, run)
                                      + ["--skip-train"]))
        results["eval"][name] = summary["eval"][-1][1]["lm loss"]
    if torch.distributed.get_rank() == 0:
        (run / "results.json").write_text(json.dumps(results))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    weights = random_gpt2(HF_CONFIG)
    return write_hf_gpt2(tmp_path_factory.mktemp("hf") / "gpt2", HF_CONFIG, weights), weights


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_dir, prepared_data):
    run = tmp_path_factory.mktemp("hf_runs")
    write_configs(run)
    conversions = convert_all({"dense": ("--from-hf", hf_dir[0], "--save", run / "hf_dense"),
                               "moe": ("--upcycle", "--load", hf_dir[0], "--save", run / "hf_moe",
                                       "--num-experts", 4, "--moe-router-topk", 2)})
    for name, proc in conversions.items():
        assert proc.returncode == 0, f"{name}: {proc.stdout}\n{proc.stderr[-3000:]}"
    torchrun(str(Path(__file__).relative_to(REPO)), 4, "worker", str(run), timeout=900)
    return json.loads((run / "results.json").read_text()), conversions


def reference_losses(weights) -> torch.Tensor:
    """Per-token losses of the Hugging Face GPT-2 as Megatron scores them: over the vocabulary
    padded to a multiple of 128 (padded entries' logit 0, the zero rows of the embedding)."""
    from megatron_parm.data.vocab import padded_vocab_size

    tokens, labels = fixed_batch()
    logits = gpt2_logits(weights, HF_CONFIG, tokens)
    pad = padded_vocab_size(HF_CONFIG["vocab_size"], 1) - HF_CONFIG["vocab_size"]
    logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], pad)], dim=-1)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             reduction="none").view(BATCH, SEQ)


def test_dense_import_computes_hugging_face_gpt2(runs, hf_dir):
    results, conversions = runs
    assert "from Hugging Face GPT-2" in conversions["dense"].stdout
    ours = torch.tensor(results["losses"]["dense"])
    reference = reference_losses(hf_dir[1])
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS[1:]])
def test_upcycled_moe_computes_the_dense_model(runs, name):
    results, conversions = runs
    assert "4 experts per layer (top-2) copied from Hugging Face GPT-2" in conversions["moe"].stdout
    torch.testing.assert_close(torch.tensor(results["losses"][name]),
                               torch.tensor(results["losses"]["dense"]), rtol=1e-5, atol=1e-5)


def test_trainer_first_loss_of_upcycled_moe_is_the_dense_loss(runs):
    results, _ = runs
    dense, moe = results["eval"]["dense"], results["eval"]["moe 2,2,1 parm"]
    assert abs(dense - moe) <= 1e-5, (dense, moe)


def test_safetensors_and_pytorch_bin_convert_identically(hf_dir, tmp_path):
    from megatron_parm.checkpointing.hf_gpt2 import hf_gpt2_to_full

    bin_dir = write_hf_gpt2(tmp_path / "bin", HF_CONFIG, hf_dir[1], fmt="bin")
    a, b = hf_gpt2_to_full(str(hf_dir[0])), hf_gpt2_to_full(str(bin_dir))
    assert sorted(a.tensors) == sorted(b.tensors) and a.objects == b.objects
    for key, tensor in a.tensors.items():
        assert torch.equal(tensor, b.tensors[key]), key


def test_qkv_is_regrouped_per_head(hf_dir):
    """Megatron's fused QKV rows are [q_h, k_h, v_h] per head h (head size d)."""
    from megatron_parm.checkpointing.hf_gpt2 import hf_gpt2_to_full

    weights, heads, hidden = hf_dir[1], HF_CONFIG["n_head"], HF_CONFIG["n_embd"]
    d = hidden // heads
    qkv = hf_gpt2_to_full(str(hf_dir[0])).tensors["decoder.layers.self_attention.linear_qkv.weight"][1]
    c_attn = weights["h.1.attn.c_attn.weight"].t()  # [3H, H]: all q, all k, all v
    for h in range(heads):
        for part in range(3):
            assert torch.equal(qkv[(3 * h + part) * d:(3 * h + part + 1) * d],
                               c_attn[part * hidden + h * d:part * hidden + (h + 1) * d])


def _broken(tmp_path, hf_dir, edit_config=None, edit_weights=None):
    config, weights = dict(HF_CONFIG), dict(hf_dir[1])
    if edit_config:
        edit_config(config)
    if edit_weights:
        edit_weights(weights)
    return write_hf_gpt2(tmp_path / "broken", config, weights)


@pytest.mark.parametrize("case, expected", [
    ("not gpt2", "model_type 'bert'"),
    ("activation", "activation_function 'relu'"),
    ("missing weight", "'h.1.mlp.c_fc.weight' missing"),
    ("untied head", "lm_head.weight differs"),
    ("truncated", "model.safetensors"),
])
def test_bad_hugging_face_directory_refused_naming_what(tmp_path, hf_dir, case, expected):
    if case == "not gpt2":
        directory = _broken(tmp_path, hf_dir)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    elif case == "activation":
        directory = _broken(tmp_path, hf_dir, edit_config=lambda c: c.update(activation_function="relu"))
    elif case == "missing weight":
        directory = _broken(tmp_path, hf_dir, edit_weights=lambda w: w.pop("h.1.mlp.c_fc.weight"))
    elif case == "untied head":
        directory = _broken(tmp_path, hf_dir, edit_weights=lambda w: w.update(
            {"lm_head.weight": w["wte.weight"] + 1}))
    else:
        directory = _broken(tmp_path, hf_dir)
        blob = (directory / "model.safetensors").read_bytes()
        (directory / "model.safetensors").write_bytes(blob[:len(blob) // 2])
    proc = convert("--upcycle", "--load", directory, "--save", tmp_path / "out",
                   "--num-experts", 4)
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # nothing half-written


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker(sys.argv[2])


def test_import_pads_the_vocabulary_as_make_vocab_size_divisible_by_says(hf_dir):
    """--from-hf --make-vocab-size-divisible-by 300: 8000 tokens padded to 8100 (zero rows), the
    padding recorded with the flags; Megatron-LM's default 128 gives 8064."""
    from megatron_parm.checkpointing.hf_gpt2 import hf_gpt2_to_full

    default, padded = hf_gpt2_to_full(str(hf_dir[0])), hf_gpt2_to_full(str(hf_dir[0]), 300)
    embedding = padded.tensors["embedding.word_embeddings.weight"]
    assert default.common["model_info"]["padded_vocab_size"] == 8064
    assert padded.common["model_info"]["padded_vocab_size"] == embedding.shape[0] == 8100
    assert padded.common["args"]["make_vocab_size_divisible_by"] == 300
    assert torch.equal(embedding[:8000], default.tensors["embedding.word_embeddings.weight"][:8000])
    assert not embedding[8000:].any()
