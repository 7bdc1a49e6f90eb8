"""Shared fixtures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch import REPO

CACHE_PREFIXES = ("data/cache/gpt_text_document", "data/cache/bert_text_sentence")


@pytest.fixture(scope="session")
def prepared_data():
    """The shipped corpus as indexed datasets (built offline once if missing: docs/pretraining.md)."""
    if not all((REPO / f"{p}{ext}").is_file() for p in CACHE_PREFIXES for ext in (".bin", ".idx")):
        subprocess.run(["bash", "pretrain_scripts/prepare_data.sh"], cwd=REPO, check=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    return [REPO / p for p in CACHE_PREFIXES]
