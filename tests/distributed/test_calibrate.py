"""tools/calibrate.py: a tiny 4-rank run writes a profile load_profile accepts; bad flags name
themselves. Plain loopback (no emulator), so the numbers mean nothing: only that every
(kind, link) was measured, fitted and written, with the residual table printed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launch import REPO, torchrun
from megatron_parm.perf_model import COLLECTIVE_KINDS, LINKS, load_profile

# 64x from the smallest to the largest size, so that even on unshaped loopback the time per
# byte stands clear of the per-call noise and every beta comes out positive.
TINY = ["--sizes", "64KiB..4MiB:3", "--warmup", "1", "--reps", "3", "--compute-rows", "64,512"]


def config_without_corpus(folder, **changes):
    """The tiny config the framework terms time, with its corpus and tokenizer moved to paths
    that do not exist (and CHANGES): calibration feeds random tokens, as on a fresh clone."""
    import yaml

    config = yaml.safe_load((REPO / "configs/gpt2_tiny_moe.yaml").read_text())
    config.update(data_path=str(folder / "no_corpus_document"),
                  tokenizer_model=str(folder / "no_tokenizer.model"), **changes)
    path = folder / "step_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # 2 "nodes" x 2 ranks by the rank rule alone: TP = ETP = {0,1},{2,3} (intra), EP =
    # {0,2},{1,3} (inter), so both link classes are timed on one machine.
    folder = tmp_path_factory.mktemp("calibrate")
    path = folder / "tiny_measured.yaml"
    proc = torchrun("tools/calibrate.py", 4, *TINY, "--ranks-per-node", "2", "--layer-tokens",
                    "16,32", "--layer-num-experts", "4", "--layer-hidden-size", "64",
                    "--layer-ffn-hidden-size", "64", "--step-config",
                    str(config_without_corpus(folder)),
                    "--output", str(path), "--note", "loopback test", timeout=300)
    return path, proc.stdout


def test_writes_a_measured_profile(run):
    path, _ = run
    profile = load_profile(path)
    assert profile.name == "tiny_measured"
    assert profile.provenance == "measured"
    assert "loopback test" in profile.note and "tp=2 ep=2 etp=2" in profile.note
    assert "copied" not in profile.note  # both link classes were measured
    for kind in COLLECTIVE_KINDS:
        for link in LINKS:
            assert profile.alpha[kind][link] >= 0
            assert profile.beta[kind][link] >= 0, (kind, link)
    # On an unshaped, shared machine a single small fit can come out flat; most cannot.
    assert sum(profile.beta[k][link] > 0 for k in COLLECTIVE_KINDS for link in LINKS) >= 6
    assert profile.compute_beta > 0
    assert profile.chunk_overhead >= 0 and profile.layer_scale > 0
    assert 0 <= profile.overlap_efficiency <= 1


def test_fits_the_in_layer_terms_on_the_real_layer(run):
    _, stdout = run
    assert "in-layer terms: layer_scale" in stdout and "per extra chunk" in stdout
    # one line per timed layer: 3 layouts x 2 token counts x (parm_s1, parm_s2 at 2 and 8
    # chunks), the layouts the model chooses between
    lines = [line for line in stdout.splitlines() if " experts seq" in line]
    assert len(lines) == 18 and sum("parm_s2 c=8" in line for line in lines) == 6
    for layout in ("(2,2,2)", "(2,2,1)", "(1,4,1)"):
        assert sum(line.lstrip().startswith(layout) for line in lines) == 6, layout
    assert "layer fit: |error| median" in stdout


def test_fits_the_framework_terms_and_writes_every_term(run):
    path, stdout = run
    assert "framework terms: microbatch_overhead" in stdout
    assert len([line for line in stdout.splitlines()
                if re.search(r" x [12] micro-batch(es)?: measured", line)]) == 4
    profile = load_profile(path, require_terms=True)  # no term missing
    assert profile.microbatch_overhead >= 0 and profile.layer_overhead >= 0
    assert profile.chunk_expert_overhead >= 0


def test_one_rank_needs_a_base_profile(tmp_path):
    proc = subprocess.run([sys.executable, "tools/calibrate.py", *TINY, "--ranks-per-node", "1",
                           "--output", str(tmp_path / "one.yaml")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--base-profile" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "one.yaml").exists()


def test_prints_fit_and_residuals(run):
    _, stdout = run
    assert "residuals" in stdout and "fit (T = alpha + beta" in stdout
    lines = [line for line in stdout.splitlines() if line.endswith("%")]
    # one line per point: 4 kinds x 2 links x 3 sizes, compute: 2 row counts x fwd/bwd
    assert len([line for line in lines if line.startswith(COLLECTIVE_KINDS)]) == 4 * 2 * 3
    assert len([line for line in lines if line.startswith("compute")]) == 4
    for kind in COLLECTIVE_KINDS:
        for link in LINKS:
            assert any(line.split()[:2] == [kind, link] and "3 sizes" in line
                       for line in stdout.splitlines())


def test_fit_and_fill_without_a_launch():
    """The pure half: an exact line is recovered; a link class with no group is copied from
    the other one (and says so); a kind measured nowhere is an error."""
    from megatron_parm.perf_model import calibrate as cal

    points = [cal.Point(kind, "intra", "expt_tp", s, s / 2, [1e-3 + 1e-8 * s / 2])
              for kind in COLLECTIVE_KINDS for s in (4096, 65536, 1 << 20)]
    points += [cal.Point("compute", "", "forward", r, r * 1e6, [1e-4 + 1e-15 * r * 1e6])
               for r in (16, 256)]
    fits = cal.fit_points(points)
    fit = fits[("all_to_all", "intra")]
    assert fit.alpha == pytest.approx(1e-3) and fit.beta == pytest.approx(1e-8)
    assert max(abs(r) for r in fit.residuals()) < 1e-9
    copied = cal.fill_missing(fits)
    assert copied == [f"{kind}.inter <- {kind}.intra" for kind in COLLECTIVE_KINDS]
    assert fits[("all_gather", "inter")].copied_from == "intra"
    assert "copied from intra" in cal.format_fit_table(fits)
    profile = cal.build_profile(fits, "one_node", "test")
    assert profile.beta["all_reduce"]["inter"] == pytest.approx(1e-8)
    with pytest.raises(ValueError, match="no all_to_all measurement"):
        cal.fill_missing({("compute", ""): fits[("compute", "")]})


@pytest.mark.parametrize("flags,named", [
    (["--sizes", "16KiB..lots"], "--sizes"),
    (["--sizes", "16KiB"], "--sizes"),
    (["--reps", "0"], "--reps"),
    (["--compute-rows", "0..8"], "--compute-rows"),
    (["--output", "profile.txt"], "--output"),
    (["--expert-model-parallel-size", "3"], "--expert-model-parallel-size"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--layer-tokens", "7"], "--layer-tokens"),
    (["--layer-num-experts", "3"], "--layer-num-experts"),
    # 2 nodes x 2: ep=4 mixes on- and off-node peers, tp = etp = 1: nothing to time
    (["--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "4"],
     "--expert-model-parallel-size"),
])
def test_bad_flag_names_itself(flags, named):
    # Checked before any process group: a single process with torchrun's variables suffices.
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "tools/calibrate.py", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr, proc.stderr


def test_a_bad_step_config_or_output_stops_before_any_timing(tmp_path):
    """The step timing's model and the output's folder are checked with the flags, in seconds:
    one line naming the flag, exit 2, nothing written."""
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}
    bad_heads = config_without_corpus(tmp_path, num_attention_heads=3)
    for flags, named in ((["--step-config", str(bad_heads)], "--num-attention-heads"),
                         (["--output", str(tmp_path / "missing" / "p.yaml")], "--output")):
        proc = subprocess.run([sys.executable, "tools/calibrate.py", *flags,
                               "--output" if "--output" not in flags else "--note",
                               str(tmp_path / "p.yaml") if "--output" not in flags else "x"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and named in last and "Traceback" not in proc.stderr, \
            proc.stderr
        assert not (tmp_path / "p.yaml").exists()
