"""Run Megatron-LM's own MoE training configurations here, as a Megatron-LM user would: their
command lines with only the data and tokenizer paths and the sizes changed, and the dispatcher
set to `parm`.

    python tools/megatron_lm_configs.py --megatron-lm ~/Megatron-LM          # every config
    python tools/megatron_lm_configs.py --megatron-lm ~/Megatron-LM --only mixtral_8x7b --show

--megatron-lm is a checkout of Megatron-LM at core_v0.16.1 (the tag of the Megatron-Core this
project pins); its files are read, never copied here. The configurations are the training ones
of its functional tests (tests/functional_tests/test_cases/{moe,mixtral}/*/model_config.yaml:
their MODEL_ARGS; the inference and RL cases are left out) and examples/mixtral's script.

For each one, on this machine (up to 8 ranks, gloo, fp32 or the config's bf16):
  1. the adapted command line with --moe-token-dispatcher-type parm: it trains, or stops in one
     line naming the flags it cannot run (`error: not available here: ...`);
  2. where it stopped, the same without the flags that line named: it must train when each of
     them needs a GPU or Transformer Engine;
  3. the config's own dispatcher (allgather where it names none; flex as alltoall, which flex
     computes) on the same command line; the lm losses of 2 (or 1) must follow its losses to
     1e-4 in fp32 and to bf16's rounding in bf16, iteration by iteration.
Writes one JSON line per configuration to --output and the table of docs/megatron_lm_configs.md
(--report). What "sizes changed" means is adapt()'s docstring.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_parm import cli  # noqa: E402

CASES = ("moe", "mixtral")
EXAMPLE = "examples/mixtral/train_mixtral_8x7b_distributed.sh"
DATA_PATH = "data/cache/gpt_text_document"
TOKENIZER_MODEL = "data/tokenizer/spm_8k.model"
MAX_RANKS = 8
ITERATIONS = 20
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 2.0 ** -7  # relative: a few roundings of bf16's 8-bit significand
# The refusal reasons that a user with a GPU and Transformer Engine would not meet.
GPU_OR_TE = ("needs a GPU", "needs Transformer Engine", "on a GPU", "CUDA graphs need a GPU",
             "needs DeepEP", "FP8 / FP4 training needs")
# Folders and files of the configs that name the user's machine.
PATH_FLAGS = ("--save", "--load", "--tensorboard-dir", "--data-cache-path", "--wandb-save-dir",
              "--pretrained-checkpoint")
DROPPED = ("--vocab-file", "--merge-file")  # the tokenizer's files become --tokenizer-model's


# ---------------------------------------------------------------------------------------------
# reading the configurations
# ---------------------------------------------------------------------------------------------


def read_test_case(path: str) -> Optional[List[Tuple[str, object]]]:
    """MODEL_ARGS of a functional test's model_config.yaml as (flag, value) pairs; None for an
    inference or RL case."""
    import yaml

    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if data.get("MODE") in ("inference", "rl"):
        return None
    return [(str(flag), value) for flag, value in data["MODEL_ARGS"].items()]


def read_script(path: str) -> List[Tuple[str, object]]:
    """The flags of a launch script's bash arrays (NAME=( --flag value ... )) as (flag, value)
    pairs, a switch's value True; DISTRIBUTED_ARGS, torchrun's own, left out."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    pairs: List[Tuple[str, object]] = []
    for name, body in re.findall(r"^\s*(\w+)=\(\s*(.*?)^\s*\)", text, flags=re.S | re.M):
        if name == "DISTRIBUTED_ARGS":  # torchrun's, not the training script's
            continue
        words = shlex.split(body.replace("\\\n", " "), comments=True)
        for index, word in enumerate(words):
            if not word.startswith("--"):
                continue
            value = words[index + 1] if index + 1 < len(words) and \
                not words[index + 1].startswith("--") else True
            pairs.append((word, value))
    return pairs


def configurations(megatron_lm: str) -> Dict[str, List[Tuple[str, object]]]:
    """name -> (flag, value) pairs of every training configuration, in a stable order."""
    found = {}
    for case in CASES:
        pattern = os.path.join(megatron_lm, "tests", "functional_tests", "test_cases", case, "*",
                               "model_config.yaml")
        for path in sorted(glob.glob(pattern)):
            pairs = read_test_case(path)
            if pairs is not None:
                found[os.path.basename(os.path.dirname(path))] = pairs
    script = os.path.join(megatron_lm, EXAMPLE)
    if os.path.isfile(script):
        found["examples_mixtral_8x7b"] = read_script(script)
    if not found:
        raise ValueError(f"--megatron-lm: no test cases under {megatron_lm}/tests/functional_tests"
                         f"/test_cases/{{{','.join(CASES)}}} (a Megatron-LM checkout at "
                         f"core_v0.16.1?)")
    return found


# ---------------------------------------------------------------------------------------------
# adapting one to this machine
# ---------------------------------------------------------------------------------------------


def _int(pairs: Dict[str, object], flag: str, default: Optional[int] = None) -> Optional[int]:
    value = pairs.get(flag, default)
    return None if value is None else int(value)


def _layout(pairs: Dict[str, object]) -> Dict[str, int]:
    """The parallel sizes, cut down to at most MAX_RANKS ranks: tp, pp, cp <= 2, ep <= 8 and
    at most what the world allows; the data-parallel size the smallest that holds ep x etp
    and whose dense and expert data-parallel sizes --num-distributed-optimizer-instances
    divides (as Megatron-Core requires)."""
    tp = min(_int(pairs, "--tensor-model-parallel-size", 1), 2)
    pp = min(_int(pairs, "--pipeline-model-parallel-size", 1), 2)
    cp = min(_int(pairs, "--context-parallel-size", 1), 2)
    etp = pairs.get("--expert-tensor-parallel-size")
    etp = tp if etp is None else min(int(etp), tp)
    ep = _int(pairs, "--expert-model-parallel-size", 1)
    if pairs.get("--use-tp-pp-dp-mapping") and pp > 1 and tp * cp % ep == 0:
        # Megatron-Core's rule where the stages are not outermost: ep x etp = tp x cp
        etp = min(etp, tp * cp // ep)
        ep = tp * cp // etp
    instances = _int(pairs, "--num-distributed-optimizer-instances", 1)

    def fits(dp: int) -> bool:
        dense = tp * cp * dp
        return dense % (ep * etp) == 0 and dp % instances == 0 and \
            (dense // (ep * etp)) % instances == 0

    while True:
        dp = 1
        while not fits(dp) and tp * cp * dp * pp * 2 <= MAX_RANKS:
            dp *= 2
        if fits(dp) and tp * cp * dp * pp <= MAX_RANKS:
            return dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, world=tp * cp * dp * pp)
        if ep == 1:
            raise ValueError(f"no layout of at most {MAX_RANKS} ranks fits "
                             f"--num-distributed-optimizer-instances {instances}")
        ep //= 2


# multi-latent attention's sizes, where a configuration gives them: at the configs' own (a
# 1536-wide query latent beside a hidden size of 64) its attention is most of the step
MLA_SIZES = {"--q-lora-rank": 48, "--kv-lora-rank": 32, "--qk-head-dim": 16,
             "--qk-pos-emb-head-dim": 8, "--v-head-dim": 16}


def _num_layers(pairs: Dict[str, object], pp: int, vpp: int) -> int:
    freq = pairs.get("--moe-layer-freq")
    if isinstance(freq, str) and "[" in freq:
        from megatron_parm.settings import layer_pattern

        return len(layer_pattern(freq))  # the pattern names every layer: keep them all
    layers = _int(pairs, "--num-layers", 2)
    return max(pp * vpp, min(layers, 2 * pp * vpp))


def adapt(name: str, pairs: List[Tuple[str, object]], workdir: str,
          iterations: int = ITERATIONS) -> Tuple[List[str], int]:
    """(argv, ranks) of one configuration on this machine. What changes, and nothing else:
    - paths: the shipped GPT corpus and SentencePiece model replace the data and tokenizer
      files (a tokenizer type that reads other files becomes SentencePieceTokenizer), and the
      output folders are under WORKDIR;
    - sizes: hidden 64, 4 heads of 16 channels (2 query groups with GQA), FFN 128, expert FFN
      64, multi-latent attention's latents and heads as configs/deepseek_v3_tiny_moe.yaml's
      (MLA_SIZES; before 2026-12-05 they were the configs' own), sequences of 64 tokens, 2 samples per micro-batch and 2 micro-batches per
      data-parallel rank, ITERATIONS iterations (--iterations; --train-samples, the lr schedule's iterations and
      samples, intervals and evaluation scaled to them), as many layers as a --moe-layer-freq
      pattern names or at most 2 per pipeline stage (and virtual stage), the parallel sizes
      cut to 8 ranks (_layout; with --use-tp-pp-dp-mapping and pipelining, ep x etp kept
      equal to tp x cp, Megatron-Core's rule), a --pipeline-model-parallel-layout left as
      written, a --split with a part under 0.1% (empty on the corpus) 98,1,1;
    - --moe-token-dispatcher-type parm; with context parallelism --cp-comm-type all_gather (the
      attention without Transformer Engine)."""
    given = dict(pairs)
    layout = _layout(given)
    vpp = min(_int(given, "--num-virtual-stages-per-pipeline-rank", 1), 2) if layout["pp"] > 1 \
        else 1
    layers = _num_layers(given, layout["pp"], vpp)
    micro_batch = 2
    global_batch = micro_batch * layout["dp"] * 2 * (layout["pp"] if layout["pp"] > 1 else 1)
    sizes = {
        "--tensor-model-parallel-size": layout["tp"], "--pipeline-model-parallel-size":
        layout["pp"], "--context-parallel-size": layout["cp"],
        "--expert-model-parallel-size": layout["ep"], "--num-layers": layers,
        "--hidden-size": 64, "--num-attention-heads": 4, "--kv-channels": 16,
        "--ffn-hidden-size": 128, "--moe-ffn-hidden-size": 64,
        "--moe-shared-expert-intermediate-size": 64, "--seq-length": 64,
        **MLA_SIZES,
        "--max-position-embeddings": 64, "--micro-batch-size": micro_batch,
        "--global-batch-size": global_batch, "--num-query-groups": 2,
        "--log-interval": 1, "--eval-interval": iterations // 2, "--eval-iters": 2,
        "--save-interval": iterations // 2,
    }
    samples = iterations * global_batch
    scaled = {"--train-iters": iterations, "--train-samples": samples,
              "--lr-decay-iters": iterations, "--lr-decay-samples": samples,
              "--lr-warmup-iters": 2, "--lr-warmup-samples": 2 * global_batch,
              "--lr-wsd-decay-iters": iterations // 2, "--lr-wsd-decay-samples": samples // 2,
              # a multiple of --save-interval (Megatron-LM's rule)
              "--save-retain-interval": 2 * (iterations // 2),
              "--num-virtual-stages-per-pipeline-rank": vpp,
              "--num-layers-per-virtual-pipeline-stage": max(1, layers // (layout["pp"] * vpp)),
              "--recompute-num-layers": 1, "--decoder-first-pipeline-num-layers": 1,
              "--decoder-last-pipeline-num-layers": 1}
    if "--expert-tensor-parallel-size" in given or layout["etp"] != layout["tp"]:
        sizes["--expert-tensor-parallel-size"] = layout["etp"]
    if "--split" in given:
        sizes["--split"] = _split(given["--split"])
    argv: List[str] = []
    done = set()
    for flag, value in pairs:
        if flag in DROPPED or value is False or flag in done:
            continue
        done.add(flag)
        if flag in sizes or flag in scaled:
            value = sizes.get(flag, scaled.get(flag))
        elif flag in PATH_FLAGS:
            value = os.path.join(workdir, flag.strip("-"))
        elif flag == "--data-path":
            value = DATA_PATH
        elif flag == "--tokenizer-model":
            value = TOKENIZER_MODEL
        elif flag == "--moe-token-dispatcher-type":
            value = "parm"
        elif flag == "--rampup-batch-size":
            value = f"{global_batch // 2} {global_batch // 2} {samples // 4}"
        argv.append(flag)
        if value is not True:
            argv.extend(str(value).split() if flag == "--rampup-batch-size" else _words(value))
    for flag in ("--tensor-model-parallel-size", "--expert-model-parallel-size", "--num-layers",
                 "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                 "--global-batch-size", "--log-interval", "--expert-tensor-parallel-size"):
        if flag not in done and flag in sizes:
            argv += [flag, str(sizes[flag])]
    if "--train-iters" not in done and "--train-samples" not in done:
        argv += ["--train-iters", str(iterations)]
    if "--tokenizer-type" not in done or given.get("--tokenizer-type") not in (
            "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        argv = _replace(argv, "--tokenizer-type", "SentencePieceTokenizer")
    if "--tokenizer-model" not in done:
        argv += ["--tokenizer-model", TOKENIZER_MODEL]
    if "--data-path" not in done:
        argv += ["--data-path", DATA_PATH]
    if "--moe-token-dispatcher-type" not in done:
        argv += ["--moe-token-dispatcher-type", "parm"]
    if layout["cp"] > 1:  # p2p, Megatron-LM's default, needs Transformer Engine's attention
        argv = _replace(argv, "--cp-comm-type", "all_gather")
    for flag in ("--lr", "--num-experts"):
        if flag not in done:
            raise ValueError(f"{name}: no {flag}")
    return argv, layout["world"]


def _split(value: object) -> str:
    """--split for the shipped corpus (about 2700 sequences of 64 tokens): as given, unless a
    part is under 0.1%, which holds no sequence of it (examples/mixtral's 99990,8,2), then
    98,1,1."""
    parts = [float(part) for part in str(value).replace("/", ",").split(",")]
    return str(value) if min(parts) * 1000 >= sum(parts) else "98,1,1"


def _words(value: object) -> List[str]:
    r"""A config value as the words Megatron-LM's functional-test runner passes: it trims the
    value through xargs (quotes and backslashes read once), then evals the command line (read
    again): a value in [ ] is its space-separated words (a list flag's values), one in ( ) or
    with a space one quoted word, any other value the word the shell reads
    (`Et*2\\|\\(tt\\|\\)*5t\\|tmL` in a YAML file is `Et*2|(tt|)*5t|tmL`)."""
    text = " ".join(shlex.split(str(value)))  # xargs
    if re.fullmatch(r"\[[^]]+\]", text):
        return shlex.split(text[1:-1])
    if re.fullmatch(r"\([^)]+\)", text) or " " in text:
        return [text]
    return shlex.split(text)


def _replace(argv: List[str], flag: str, value: str) -> List[str]:
    """argv with FLAG set to VALUE (added where it is not there)."""
    if flag in argv:
        index = argv.index(flag)
        return argv[:index + 1] + [value] + argv[index + 2:]
    return argv + [flag, value]


def without(argv: List[str], flags: List[str]) -> List[str]:
    """argv without FLAGS and their values."""
    out, skip = [], False
    for word in argv:
        if skip and not word.startswith("--"):
            continue
        skip = word in flags
        if not skip:
            out.append(word)
    return out


def own_dispatcher(pairs: List[Tuple[str, object]]) -> str:
    """The dispatcher the configuration runs in Megatron-LM (flex computes alltoall's)."""
    from megatron_parm.settings import megatron_lm

    value = dict(pairs).get("--moe-token-dispatcher-type",
                            megatron_lm.option("--moe-token-dispatcher-type").default)
    return "alltoall" if value == "flex" else str(value)


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------

_LOSS = re.compile(r"iteration\s+(\d+)/.*?\blm loss: ([0-9.eE+-]+)")
_REFUSED = re.compile(r"^error: not available here: (.*)$", re.M)


def refused_flags(stderr: str) -> List[Tuple[str, str]]:
    """(flag, reason) of the one `error: not available here:` line, if any."""
    match = _REFUSED.search(stderr)
    if not match:
        return []
    found = []
    for item in match.group(1).split("; "):
        flag, _, reason = item.partition(": ")
        found.append((flag.split()[0], reason))
    return found


def run(argv: List[str], ranks: int, port: int, timeout: int) -> dict:
    """One launch through megatron_parm.launch: status, seconds, lm loss per iteration, the
    refusal line's flags and the last stderr lines."""
    command = [sys.executable, "-m", "megatron_parm.launch", "--nproc-per-node", str(ranks),
               "--master-port", str(port), "pretrain_scripts/pretrain_gpt2_moe.py", *argv]
    start = time.time()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, err = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        # SIGTERM: the launcher stops its ranks (each in a session of its own) and exits; a
        # SIGKILL would leave them running, orphaned, slowing every later launch
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        status = "timeout"
    losses = {int(it): float(loss) for it, loss in _LOSS.findall(out)}
    return dict(status=status, seconds=round(time.time() - start, 1),
                losses=[losses[k] for k in sorted(losses)], refused=refused_flags(err),
                tail=[line for line in err.strip().splitlines()[-3:]])


def needs_gpu_or_te(reason: str) -> bool:
    return any(mark in reason for mark in GPU_OR_TE)


def compare(losses: List[float], reference: List[float], bf16: bool) -> Tuple[float, bool]:
    """(largest difference, within tolerance): absolute 1e-4 in fp32, relative 2^-7 in bf16."""
    if not losses or len(losses) != len(reference):
        return float("inf"), False
    if bf16:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        return worst, worst <= BF16_TOLERANCE
    worst = max(abs(a - b) for a, b in zip(losses, reference))
    return worst, worst <= FP32_TOLERANCE


def check(name: str, pairs: List[Tuple[str, object]], port: int, timeout: int,
          iterations: int = ITERATIONS) -> dict:
    """The three steps of the module docstring for one configuration (each launch with folders
    of its own)."""
    record: dict = dict(name=name, own_dispatcher=own_dispatcher(pairs), iterations=iterations)
    removed: List[str] = []

    def launch(dispatcher: str) -> dict:
        with tempfile.TemporaryDirectory(prefix="mlm-config-") as workdir:
            argv, ranks = adapt(name, pairs, workdir, iterations)
            argv = _replace(without(argv, removed), "--moe-token-dispatcher-type", dispatcher)
            record.update(ranks=ranks, argv=argv)
            return run(argv, ranks, port, timeout)

    parm = record["first"] = launch("parm")
    if parm["refused"]:
        record["gpu_or_te_only"] = all(needs_gpu_or_te(r) for _, r in parm["refused"])
        if not record["gpu_or_te_only"]:
            return record
        removed = [flag for flag, _ in parm["refused"]]
        parm = record["without_refused"] = launch("parm")
    if parm["status"] != 0:
        return record
    reference = record["reference"] = launch(record["own_dispatcher"])
    worst, ok = compare(parm["losses"], reference["losses"], "--bf16" in record["argv"])
    record.update(largest_difference=worst, losses_follow=ok)
    return record


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


def verdict(record: dict) -> str:
    first = record["first"]
    if first["refused"] and not record.get("gpu_or_te_only"):
        return "refused: not only GPU/TE flags"
    last = record.get("without_refused", first)
    if last["status"] != 0:
        return f"failed ({last['status']})"
    return "losses follow" if record.get("losses_follow") else "losses differ"


def report(records: List[dict], megatron_lm: str) -> str:
    lines = [
        "# Megatron-LM's own MoE configurations, run here",
        "",
        "<!-- written by tools/megatron_lm_configs.py --report; the table is its last run -->",
        "",
        f"Each row is one of Megatron-LM's MoE training configurations ({megatron_lm}: "
        f"tests/functional_tests/test_cases/{{moe,mixtral}}, examples/mixtral), with only the data "
        f"and tokenizer paths and the sizes changed (tools/megatron_lm_configs.py, adapt()) and "
        f"`--moe-token-dispatcher-type parm`, on this machine. *First run*: what that command "
        f"line did. *Without them*: the run without the flags the refusal named, where each needs "
        f"a GPU or Transformer Engine. *Own dispatcher*: the same command line with the "
        f"configuration's own dispatcher (flex as alltoall); the largest difference of the lm "
        f"loss over {ITERATIONS} iterations unless the cell says otherwise (absolute in fp32, tolerance {FP32_TOLERANCE}; "
        f"relative in bf16, tolerance 2^-7).",
        "",
        "| configuration | ranks | first run | without them | own dispatcher | largest difference"
        " | verdict | what stopped it |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for record in records:
        first = record["first"]
        said = ("trained" if first["status"] == 0 else
                "refused " + ", ".join(f"`{flag}`" for flag, _ in first["refused"])
                if first["refused"] else f"failed ({first['status']})")
        second = record.get("without_refused")
        second = "" if second is None else ("trained" if second["status"] == 0 else
                                            f"failed ({second['status']})")
        worst = record.get("largest_difference")
        iterations = record.get("iterations", ITERATIONS)
        over = "" if iterations == ITERATIONS else f" ({iterations} iterations)"
        lines.append(f"| {record['name']} | {record.get('ranks', '')} | {said} | {second} | "
                     f"{record.get('own_dispatcher', '')} | "
                     f"{'' if worst is None else f'{worst:.2e}{over}'} | {verdict(record)} | "
                     f"{stop_reason(record)} |")
    return "\n".join(lines) + "\n"


def stop_reason(record: dict) -> str:
    """The line that stopped a configuration that did not train to the end (its refusal of
    flags that do not all need a GPU or Transformer Engine, or its failure), for the table."""
    first = record["first"]
    if first["refused"] and not record.get("gpu_or_te_only"):
        line = "; ".join(f"{flag}: {why}" for flag, why in first["refused"]
                         if not needs_gpu_or_te(why))
    else:
        last = record.get("without_refused", first)
        if last["status"] == 0:
            return ""
        tail = last.get("tail") or []
        line = next((line for line in tail if line.startswith("error:")),
                    tail[-1] if tail else "")
    return line.replace("|", "\\|")[:300]


def newest_records(path: str, names: List[str]) -> List[dict]:
    """The newest record of each configuration in the JSON lines at PATH, in NAMES' order."""
    newest = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                newest[record["name"]] = record
    return [newest[name] for name in names if name in newest]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True,
                        help="a Megatron-LM checkout at core_v0.16.1")
    parser.add_argument("--only", help="a substring of the configurations' names to run")
    parser.add_argument("--show", action="store_true",
                        help="print the adapted command lines and stop")
    parser.add_argument("--output", default="megatron_lm_configs.jsonl",
                        help="JSON lines, one per configuration (appended)")
    parser.add_argument("--report", help="write the markdown table here (docs/megatron_lm_configs.md)")
    parser.add_argument("--from-records", action="store_true",
                        help="run nothing: write --report from --output's records, the newest "
                             "of each configuration")
    parser.add_argument("--master-port", type=int, default=29571)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--iterations", type=int, default=ITERATIONS,
                        help="training iterations of each launch (fewer for the configs that "
                             "take this machine longest; the report says so)")
    args = parser.parse_args(argv)
    if args.iterations < 2:
        raise ValueError(f"--iterations {args.iterations}: give 2 or more (a checkpoint and an "
                         f"evaluation halfway)")
    found = configurations(args.megatron_lm)
    if args.only:
        found = {name: pairs for name, pairs in found.items() if args.only in name}
        if not found:
            raise ValueError(f"--only {args.only}: no configuration's name holds it")
    if args.from_records:
        if not args.report:
            raise ValueError("--from-records: give --report, the file to write")
        with open(args.report, "w", encoding="utf-8") as handle:
            handle.write(report(newest_records(args.output, list(found)),
                                "Megatron-LM core_v0.16.1"))
        return 0
    if args.show:
        for name, pairs in found.items():
            command, ranks = adapt(name, pairs, "WORKDIR")
            print(f"# {name} ({ranks} ranks)\n{shlex.join(command)}\n")
        return 0
    records = []
    for name, pairs in found.items():
        record = check(name, pairs, args.master_port, args.timeout, args.iterations)
        records.append(record)
        print(f"{name}: {verdict(record)}", flush=True)
        with open(args.output, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as handle:
            handle.write(report(records, "Megatron-LM core_v0.16.1"))
    return 0


if __name__ == "__main__":
    cli.run(main)
