"""Shared fixtures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch import REPO, hide_test_only_packages

hide_test_only_packages()  # for every process the tests start (tests/hidden/transformers)

CACHE_PREFIXES = ("data/cache/gpt_text_document", "data/cache/bert_text_sentence")


@pytest.fixture(scope="session")
def prepared_data():
    """The shipped corpus as indexed datasets (built offline once if missing: docs/pretraining.md)."""
    if not all((REPO / f"{p}{ext}").is_file() for p in CACHE_PREFIXES for ext in (".bin", ".idx")):
        subprocess.run(["bash", "pretrain_scripts/prepare_data.sh"], cwd=REPO, check=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    return [REPO / p for p in CACHE_PREFIXES]


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """World size 1 with Megatron-Core's own process groups (its parallel_state, no setup of
    ours beyond mcore_compat) and the model-parallel seed; torch.distributed is closed after."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_parm import mcore_compat

    assert not dist.is_initialized()
    rendezvous = tmp_path_factory.mktemp("megatron_world") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    mcore_compat.setup()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
