"""S2 computes TorchGroupedMLP's weight gradients once per layer call, not once per chunk.

One 1-rank launch of deferred_wgrad_worker.py: S2 at several forward/backward chunk counts,
the experts' weight gradients deferred (as S2 runs them) and per chunk, against alltoall
with the same weights. Deferred, each expert weight's gradient is accumulated once per
backward whatever the chunk count, and the results stay those of alltoall (the suite's
tolerance; bit-identical at one chunk, where deferring changes nothing but when). With fewer
rows than sub-chunks, the empty sub-chunks' graphs get their backward too: per chunk, the
weights' gradients are accumulated once per backward chunk all the same (S2 used to skip them,
and a rank whose experts got no token gave its expert weights no gradient at all).
"""

from __future__ import annotations

import json

import pytest

from launch import torchrun

TOL = 1e-5  # float32, as tests/distributed/test_dispatchers.py
BF16_TOL = 3e-2


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("deferred") / "records.json"
    torchrun("tests/distributed/deferred_wgrad_worker.py", 1, str(out), timeout=600)
    return json.loads(out.read_text())


def _chunks(variant):
    counts = variant.split("@")[1].split("/")
    return int(counts[0]), int(counts[-1])


def test_every_quantity_compared(records):
    assert len(records) == 2 * (5 + 2 + 1)
    for r in records:
        assert r["quantities"] == r["reference"], r["variant"]
        assert {"y", "x", "experts.weight1", "experts.weight2"} <= set(r["quantities"])


def test_same_as_alltoall(records):
    for r in records:
        tol = TOL if r["dtype"] == "float32" else BF16_TOL
        bad = {q: e for q, e in r["err"].items() if not e <= tol}
        bad.update({f"{q} (accumulated)": e for q, e in r["err_accumulated"].items() if not e <= tol})
        assert not bad, (r["variant"], r["mode"], r["dtype"], bad)


def test_weight_gradient_accumulated_once_per_backward(records):
    for r in records:
        _, bwd = _chunks(r["variant"])
        # per chunk: one autograd call per backward chunk (over its sub-chunks' graphs)
        expected = 1 if r["mode"] == "deferred" else bwd
        assert r["hits"] == {"experts.weight1": expected, "experts.weight2": expected}, r


def test_empty_sub_chunks_have_their_backward(records):
    few = [r for r in records if r["rows"] < 4]
    assert [(r["variant"], r["mode"]) for r in few] == [("parm_s2@2/4", "deferred"),
                                                        ("parm_s2@2/4", "per_chunk")]
    # (the general per-chunk count, 4 here, is test_weight_gradient_accumulated_once_per_backward's)
    assert few[1]["hits"] == {"experts.weight1": 4, "experts.weight2": 4}, few[1]


def test_one_chunk_bit_identical(records):
    for r in records:
        if r["variant"] == "parm_s2@1" and r["mode"] == "deferred":
            assert all(r["equal_per_chunk"].values()), r["equal_per_chunk"]
