"""GPT and BERT datasets built on two gloo ranks: rank 0 writes the index caches, rank 1
waits and loads them, and both see the same samples. CPU only, about 10 s:
    python -m pytest tests/unit/test_data_multirank.py -q
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
SPM_ARGS = {"tokenizer_type": "SentencePieceTokenizer",
            "tokenizer_model": str(REPO / "data" / "tokenizer" / "spm_8k.model")}
WORLD_SIZE = 2


def _worker(rank, root):
    sys.path.insert(0, str(REPO))  # spawned interpreters start from scratch
    warnings.filterwarnings("ignore")
    from megatron_parm.data.datasets import build_bert_datasets, build_gpt_datasets
    from megatron_parm.data.loaders import build_data_iterator
    from megatron_parm.data.tokenizers import build_tokenizer

    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank,
                            world_size=WORLD_SIZE)
    try:
        tokenizer = build_tokenizer(argparse.Namespace(**SPM_ARGS))
        cache = f"{root}/cache"
        gpt = build_gpt_datasets(tokenizer, [f"{root}/gpt_text_document"], "90,8,2", 32, 3,
                                 [64, 8, 8], data_cache_path=cache)
        bert = build_bert_datasets(tokenizer, [f"{root}/bert_text_sentence"], "90,8,2", 32, 3,
                                   [64, 8, 8], data_cache_path=cache)
        gpt_batch = next(build_data_iterator(gpt[0], 2, data_parallel_rank=rank,
                                             data_parallel_size=WORLD_SIZE))
        result = {
            "gpt_sample": gpt[0][5]["tokens"].tolist(),
            "bert_sample": bert[0][5]["text"].tolist(),
            "gpt_batch": gpt_batch["tokens"].tolist(),
            "still_initialized": dist.is_initialized(),
        }
        with open(f"{root}/rank{rank}.json", "w") as handle:
            json.dump(result, handle)
    finally:
        dist.destroy_process_group()


def test_two_ranks_build_the_same_datasets(tmp_path):
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron_parm.data.preprocess import preprocess_jsonl

    with open(REPO / "data" / "corpus.jsonl", encoding="utf-8") as source, \
            open(tmp_path / "tiny.jsonl", "w", encoding="utf-8") as target:
        for _, line in zip(range(200), source):
            target.write(line)
    preprocess_jsonl(str(tmp_path / "tiny.jsonl"), str(tmp_path / "gpt"), SPM_ARGS,
                     append_eod=True)
    preprocess_jsonl(str(tmp_path / "tiny.jsonl"), str(tmp_path / "bert"), SPM_ARGS,
                     split=True)

    torch.multiprocessing.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD_SIZE)

    results = [json.loads((tmp_path / f"rank{rank}.json").read_text())
               for rank in range(WORLD_SIZE)]
    assert results[0]["gpt_sample"] == results[1]["gpt_sample"]
    assert results[0]["bert_sample"] == results[1]["bert_sample"]
    # Data-parallel ranks read different micro batches.
    assert results[0]["gpt_batch"] != results[1]["gpt_batch"]
    assert all(result["still_initialized"] for result in results)
    assert any((tmp_path / "cache").iterdir())
