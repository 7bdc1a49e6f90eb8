"""Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and DeepSeek-V2 in and out, checked
against `transformers`.

`transformers` (a test dependency) builds a tiny random model of each family, and a dense
Llama (tools/tiny_hf_model.py), and saves them in shards with their index (DeepSeek-V3's with
its MTP layer, which transformers neither builds nor runs). tools/convert_checkpoint.py imports
each (--from-hf; DeepSeek-V3 with --mtp-num-layers 1) and upcycles the Llama (--upcycle --load
DIR). One 4-rank launch (this file as a
script) then loads every import into Megatron's GPT at (tp, ep, etp) = (1, 1, 1) and (2, 2, 2)
and records the logits of one fixed batch, and trains the Qwen3-MoE 20 iterations with `parm`
at (2, 2, 2), recording each rank's first batch. The tests compare the logits with those of
`transformers`, the first training loss with the loss `transformers` computes on that batch,
and the exports (--to-hf, of the imports and of the trained checkpoint) loaded back into
`transformers` with the logits they came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tools")]

from launch import convert_all, convert_checkpoint as convert, torchrun  # noqa: E402
from tiny_hf_model import FAMILIES, write as write_hf_model  # noqa: E402  (vocabulary 8064)

SEQ, BATCH = 32, 2
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2")
IMPORT_FLAGS = {"deepseek_v3": ("--mtp-num-layers", 1)}  # its MTP layer too
LAYOUTS = {"1,1,1": (1, 1, 1, "alltoall"), "2,2,2": (2, 2, 2, "parm")}
TRAIN_ITERS = 20
DATA = ["--data-path", "data/cache/gpt_text_document", "--tokenizer-type",
        "SentencePieceTokenizer", "--tokenizer-model", "data/tokenizer/spm_8k.model"]


def fixed_tokens() -> torch.Tensor:
    return torch.randint(0, 8000, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def hf_logits(folder, tokens) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


def flags(checkpoint: Path, layout, *extra) -> list:
    tp, ep, etp, dispatcher = layout
    return (["--config", str(checkpoint / "config.yaml"), "--load", str(checkpoint),
             "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
             "--expert-tensor-parallel-size", str(etp), "--moe-token-dispatcher-type", dispatcher,
             "--seq-length", str(SEQ), "--micro-batch-size", str(BATCH), "--lr", "3e-3",
             "--train-iters", str(TRAIN_ITERS), "--lr-warmup-iters", "0", "--eval-iters", "0",
             *DATA] + (["--sequence-parallel"] if tp > 1 else []) + list(extra))


def mtp_reference_logits(folder, tokens) -> torch.Tensor:
    """DeepSeek-V3's first MTP depth as DeepSeek defines it, h_1 = shared_head.norm(layer(
    eh_proj([enorm(embed(the next tokens)); hnorm(h_0)]))), logits = shared_head.head(h_1), h_0
    the model's last hidden state: transformers' own modules, with the weights of
    model.layers.N (which transformers neither builds nor loads). The last position sees token 0
    as the next one, as Megatron-Core's MTP."""
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    from megatron_parm.checkpointing.hf_files import read_weights

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config
    prefix = f"model.layers.{config.num_hidden_layers}."
    weights = {name[len(prefix):]: tensor for name, tensor in read_weights(str(folder)).items()
               if name.startswith(prefix)}
    layer = deepseek.DeepseekV3DecoderLayer(config, config.num_hidden_layers).eval()
    state = {name: tensor for name, tensor in weights.items() if name in layer.state_dict()}
    experts = range(config.n_routed_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [weights[f"mlp.experts.{e}.gate_proj.weight"], weights[f"mlp.experts.{e}.up_proj.weight"]])
        for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([weights[f"mlp.experts.{e}.down_proj.weight"]
                                                  for e in experts])
    layer.load_state_dict(state)

    def norm(name, hidden):
        module = deepseek.DeepseekV3RMSNorm(hidden.shape[-1], eps=config.rms_norm_eps)
        module.weight.data.copy_(weights[name])
        return module(hidden)

    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state
        following = torch.roll(tokens, -1, dims=1)
        following[:, -1] = 0
        hidden = torch.cat([norm("enorm.weight", model.model.embed_tokens(following)),
                            norm("hnorm.weight", hidden)], dim=-1) @ weights["eh_proj.weight"].T
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        causal = torch.full((tokens.shape[1],) * 2, float("-inf")).triu(1)[None, None]
        hidden = layer(hidden, attention_mask=causal, position_ids=positions,
                       position_embeddings=model.model.rotary_emb(hidden, positions))
        return norm("shared_head.norm.weight", hidden) @ weights["shared_head.head.weight"].T


# ---------------------------------------------------------------------------------------------
# the 4-rank worker
# ---------------------------------------------------------------------------------------------

def model_logits(args, tokens, mtp_logits=None) -> list:
    """The logits of TOKENS of the checkpoint args.load in args' layout, gathered over TP (and
    with MTP layers, their logits appended to the list MTP_LOGITS, depth 1 first)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_parm.checkpointing import find_checkpoint, load_checkpoint, read_checkpoint_info
    from megatron_parm.parallel import initialize_model_parallel
    from megatron_parm.training.model import build_model
    from megatron_parm.training.trainer import set_seed

    initialize_model_parallel(args.tensor_model_parallel_size, args.expert_model_parallel_size,
                              args.expert_tensor_parallel_size, args.num_experts,
                              args.moe_token_dispatcher_type)
    set_seed(args.seed)
    folder = find_checkpoint(args.load).path
    padded = read_checkpoint_info(folder)["model_info"]["padded_vocab_size"]
    model = build_model(args, 8000, padded)
    load_checkpoint(folder, model, None, None, args)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    masked = ~torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    masked = masked.expand(BATCH, 1, SEQ, SEQ)
    with torch.no_grad():
        if not args.mtp_num_layers:
            logits = model.eval()(tokens, positions, masked)
        else:  # with MTP layers GPTModel needs labels and returns the loss: the logits are
            # its output layer's last call's ([s, b, V / tp]; the MTP depths' come first), copied
            # before the loss overwrites them
            calls = []
            hook = model.output_layer.register_forward_hook(
                lambda module, inputs, output: calls.append(output[0].clone()))
            model.eval()(tokens, positions, masked, labels=tokens)
            hook.remove()
            logits = calls[-1].transpose(0, 1)
            if mtp_logits is not None:
                mtp_logits += [gather_from_tensor_model_parallel_region(depth.transpose(0, 1))
                               .tolist() for depth in calls[:-1]]
        return gather_from_tensor_model_parallel_region(logits).tolist()


class first_batches:
    """Records the first micro-batch each rank's GPT forward step draws."""

    def __enter__(self):
        from megatron_parm.training import model

        self.module, self.step, self.batches = model, model.FORWARD_STEPS["gpt"], []

        def step(data_iterator, gpt):
            batch = next(data_iterator)
            if not self.batches:
                self.batches.append({key: batch[key].tolist() for key in ("tokens", "labels",
                                                                           "loss_mask")})
            return self.step(iter([batch]), gpt)

        model.FORWARD_STEPS["gpt"] = step
        return self

    def __exit__(self, *exc):
        self.module.FORWARD_STEPS["gpt"] = self.step


def worker(out_path: str, run_dir: str) -> None:
    sys.path.insert(0, str(REPO))
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import initialize_distributed, pretrain

    initialize_distributed()
    run, tokens = Path(run_dir), fixed_tokens()
    results = {"logits": {}, "mtp_logits": {}}
    for name in (*MOE, "llama_moe"):
        for layout_name, layout in LAYOUTS.items():
            args = parse_args(flags(run / f"ckpt_{name}", layout))
            mtp = results["mtp_logits"].setdefault(f"{name} {layout_name}", [])
            results["logits"][f"{name} {layout_name}"] = model_logits(args, tokens, mtp)
    trained = run / "trained_qwen3_moe"
    with first_batches() as recorded:
        summary = pretrain(parse_args(flags(run / "ckpt_qwen3_moe", LAYOUTS["2,2,2"],
                                            "--save", str(trained), "--global-batch-size",
                                            str(2 * BATCH), "--log-interval", "5")))
    results["losses"] = summary["losses"]
    batches = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(batches, recorded.batches[0])
    results["first_batches"] = batches
    args = parse_args(flags(run / "ckpt_qwen3_moe", LAYOUTS["1,1,1"]) + ["--load", str(trained)])
    results["logits"]["trained"] = model_logits(args, tokens)
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    torch.distributed.barrier()


# ---------------------------------------------------------------------------------------------
# fixtures: the Hugging Face models, their imports, the launch, the exports
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    return {family: Path(write_hf_model(family, str(folder / family), max_shard_size="200KB"))
            for family in FAMILIES}


@pytest.fixture(scope="module")
def run(tmp_path_factory, hf_models, prepared_data):
    run = tmp_path_factory.mktemp("hf_moe")
    jobs = {family: ("--from-hf", hf_models[family], "--save", run / f"ckpt_{family}",
                     *IMPORT_FLAGS.get(family, ())) for family in MOE}
    jobs["llama_moe"] = ("--upcycle", "--load", hf_models["llama"], "--save",
                         run / "ckpt_llama_moe", "--num-experts", 4, "--moe-router-topk", 2)
    conversions = convert_all(jobs)
    for name, proc in conversions.items():
        assert proc.returncode == 0, f"{name}: {proc.stdout}\n{proc.stderr[-3000:]}"
    proc = torchrun(str(Path(__file__).relative_to(REPO)), 4, "worker", str(run / "results.json"),
                    str(run), timeout=1200)
    return json.loads((run / "results.json").read_text()), conversions, run


@pytest.fixture(scope="module")
def references(hf_models):
    tokens = fixed_tokens()
    return {family: hf_logits(folder, tokens) for family, folder in hf_models.items()}


@pytest.fixture(scope="module")
def exports(run):
    _, _, folder = run
    sources = {family: folder / f"ckpt_{family}" for family in MOE}
    sources["trained"] = folder / "trained_qwen3_moe"
    procs = convert_all({name: ("--to-hf", folder / f"export_{name}", "--load", source,
                                "--max-shard-size", "150KB") for name, source in sources.items()})
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {proc.stdout}\n{proc.stderr[-3000:]}"
    return {name: folder / f"export_{name}" for name in procs}, procs


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", MOE)
def test_imported_model_computes_the_transformers_logits(run, references, family, layout):
    results, conversions, folder = run
    ours = torch.tensor(results["logits"][f"{family} {layout}"])
    torch.testing.assert_close(ours, references[family], rtol=0, atol=1e-5)
    assert (folder / f"ckpt_{family}" / "config.yaml").is_file()
    assert "train with --config" in conversions[family].stdout


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_imported_deepseek_v3_mtp_layer_computes_deepseeks_mtp(run, hf_models, layout):
    """Its MTP layer, imported as Megatron-Core's MTP block (--mtp-num-layers 1), gives the
    logits DeepSeek's definition gives with transformers' modules."""
    results, _, _ = run
    (ours,) = results["mtp_logits"][f"deepseek_v3 {layout}"]
    theirs = mtp_reference_logits(hf_models["deepseek_v3"], fixed_tokens())
    torch.testing.assert_close(torch.tensor(ours), theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_upcycled_llama_computes_the_dense_transformers_logits(run, references, layout):
    results, _, _ = run
    ours = torch.tensor(results["logits"][f"llama_moe {layout}"])
    torch.testing.assert_close(ours, references["llama"], rtol=0, atol=1e-5)


def test_imported_qwen3_moe_trains_from_the_transformers_loss(run, hf_models):
    """The first loss is the imported model's on its first batch: transformers' loss there."""
    results, _, _ = run
    losses = results["losses"]
    assert len(losses) == TRAIN_ITERS and losses[-1] < losses[0] - 0.3, losses
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["qwen3_moe"],
                                                              dtype=torch.float32).eval()
    total = count = 0.0
    # ranks 0-1 and 2-3 are the two data-parallel ranks' TP pairs: each pair read one batch
    for batch in results["first_batches"][::2]:
        with torch.no_grad():
            logits = model(torch.tensor(batch["tokens"])).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), torch.tensor(batch["labels"]).flatten(), reduction="none")
        mask = torch.tensor(batch["loss_mask"], dtype=torch.float32).flatten()
        total, count = total + float((per_token * mask).sum()), count + float(mask.sum())
    assert abs(losses[0] - total / count) <= 1e-5, (losses[0], total / count)


@pytest.mark.parametrize("family", MOE)
def test_export_gives_back_the_hugging_face_model(exports, hf_models, references, family):
    from megatron_parm.checkpointing.hf_files import read_weights

    folders, procs = exports
    assert (folders[family] / "model.safetensors.index.json").is_file()
    original, exported = read_weights(str(hf_models[family])), read_weights(str(folders[family]))
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    torch.testing.assert_close(hf_logits(folders[family], fixed_tokens()), references[family],
                               rtol=0, atol=1e-5)


def test_trained_checkpoint_exports_with_the_logits_it_computes(run, exports):
    """Saved at (2, 2, 2) after training; exported with the tokenizer's 8000 tokens."""
    results, _, _ = run
    folders, procs = exports
    assert "vocabulary 8000" in procs["trained"].stdout
    theirs = hf_logits(folders["trained"], fixed_tokens())
    ours = torch.tensor(results["logits"]["trained"])[..., :8000]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# bad input: one line, status 2, nothing written
# ---------------------------------------------------------------------------------------------

def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def _first_shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[0]


@pytest.mark.parametrize("case, expected", [
    ("architecture", "architectures 'GPTNeoXForCausalLM' (model_type 'mixtral'); supported: "
                     "GPT2LMHeadModel, Mixtral"),
    ("missing shard", "model-00001-of-"),
    ("truncated shard", "model-00001-of-"),
    ("shape", "has shape (8, 64); config.json gives (6, 64)"),
    ("layout", "--target-expert-parallel-size"),
    ("rope scaling", "rope_type={'rope_type': 'yarn'"),
    ("mtp layers", "--mtp-num-layers: MixtralForCausalLM has no MTP layers to import"),
])
def test_bad_hugging_face_input_is_one_line(tmp_path, hf_models, case, expected):
    folder = _copy(hf_models["mixtral"], tmp_path / "hf")
    extra = []
    if case == "architecture":
        _edit_config(folder, architectures=["GPTNeoXForCausalLM"])
    elif case == "missing shard":
        _first_shard(folder).unlink()
    elif case == "truncated shard":
        shard = _first_shard(folder)
        shard.write_bytes(shard.read_bytes()[:-1000])
    elif case == "shape":
        _edit_config(folder, num_local_experts=6)
    elif case == "rope scaling":
        _edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                              "rope_theta": 1e6})
    elif case == "mtp layers":
        extra = ["--mtp-num-layers", "1"]
    else:
        extra = ["--target-expert-parallel-size", "3", "--target-tensor-parallel-size", "1"]
    proc = convert("--from-hf", folder, "--save", tmp_path / "out", *extra)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: torchrun --nproc-per-node 4 tests/e2e/test_hf_moe.py worker OUT.json RUN_DIR")
    worker(sys.argv[2], sys.argv[3])
