"""Data pipeline: tokenizers, preprocessing to indexed datasets, GPT and BERT datasets.

Single process, CPU, a slice of the shipped corpus; run from the repository root:
    python -m pytest tests/unit/test_data.py -q
"""

import argparse
import json
import re
import sys
import warnings
from pathlib import Path

import numpy
import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core.tokenizers import MegatronTokenizerBase  # noqa: E402

from megatron_parm.data.datasets import (  # noqa: E402
    build_bert_datasets,
    build_gpt_datasets,
    parse_data_path,
    parse_split,
    train_valid_test_num_samples,
)
from megatron_parm.data.loaders import PretrainingBatchSampler, build_data_iterator  # noqa: E402
from megatron_parm.data.preprocess import preprocess_jsonl, split_sentences  # noqa: E402
from megatron_parm.data.tokenizers import _bytes_to_unicode, build_tokenizer  # noqa: E402
from launch import load_tool  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus.jsonl"
SPM_MODEL = REPO / "data" / "tokenizer" / "spm_8k.model"
NUM_DOCS = 300
SPM_ARGS = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": str(SPM_MODEL)}


@pytest.fixture(scope="module")
def spm_tokenizer():
    return build_tokenizer(argparse.Namespace(**SPM_ARGS))


@pytest.fixture(scope="module")
def documents():
    with open(CORPUS, encoding="utf-8") as handle:
        return [json.loads(line)["text"] for _, line in zip(range(NUM_DOCS), handle)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, documents):
    """A tiny jsonl (with an extra key and an empty document) and its GPT and BERT datasets."""
    root = tmp_path_factory.mktemp("data")
    with open(root / "tiny.jsonl", "w", encoding="utf-8") as handle:
        for i, text in enumerate(documents):
            handle.write(json.dumps({"text": text, "title": f"doc {i}"}) + "\n")
        handle.write(json.dumps({"text": "", "title": "empty"}) + "\n")
    preprocess_jsonl(str(root / "tiny.jsonl"), str(root / "gpt"), SPM_ARGS, append_eod=True)
    preprocess_jsonl(str(root / "tiny.jsonl"), str(root / "bert"), SPM_ARGS, split=True)
    return root


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------

ROUND_TRIP_TEXT = "Return x.\n\tIndented  code: f(x) == 3  # naïve ✓"


def _assert_round_trips(tokenizer, texts):
    """Each text tokenizes to ids inside the vocabulary, and those back to the text."""
    for text in texts:
        ids = tokenizer.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text


def test_shipped_sentencepiece_round_trip_and_special_ids(spm_tokenizer, documents):
    assert isinstance(spm_tokenizer, MegatronTokenizerBase)
    assert spm_tokenizer.vocab_size == 8000
    assert (spm_tokenizer.pad, spm_tokenizer.eod, spm_tokenizer.cls, spm_tokenizer.sep,
            spm_tokenizer.mask) == (0, 3, 4, 5, 6)
    assert spm_tokenizer.inv_vocab[spm_tokenizer.mask] == "[MASK]"
    assert spm_tokenizer.has_bert_special_tokens()
    _assert_round_trips(spm_tokenizer, [ROUND_TRIP_TEXT, *documents[:50]])
    # Special ids never come out of plain text.
    assert not {0, 3, 4, 5, 6} & set(spm_tokenizer.tokenize("[CLS] [SEP] [MASK] <pad> </s>"))


def test_gpt2_bpe_from_local_files(tmp_path):
    symbols = list(_bytes_to_unicode().values())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("o", "r")]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    tokenizer = build_tokenizer(argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
        merge_file=str(tmp_path / "merges.txt")))
    assert tokenizer.vocab_size == 256 + len(merges) + 1
    assert tokenizer.eod == vocab["<|endoftext|>"]
    assert tokenizer.tokenize(" the") == [vocab["Ġthe"]]
    assert tokenizer.tokenize("for") == [vocab["f"], vocab["or"]]
    text = "Hello the world! It's 2024 -- naïve_x\n\tok  "
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert not tokenizer.has_bert_special_tokens()


@pytest.mark.parametrize("tokenizer_type", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_wordpiece_from_local_vocab(tmp_path, tokenizer_type):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "Hello", ",", "world",
             "##s", "un", "##aff", "##able", "cafe", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = build_tokenizer(argparse.Namespace(
        tokenizer_type=tokenizer_type, vocab_file=str(tmp_path / "vocab.txt")))
    assert (tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (0, 2, 3, 4)
    assert tokenizer.vocab_size == len(vocab)
    assert tokenizer.inv_vocab[9] == "##s"
    ids = tokenizer.tokenize("Hello, worlds unaffable café!")
    pieces = [vocab[i] for i in ids]
    if tokenizer_type == "BertWordPieceLowerCase":
        assert pieces == ["hello", ",", "world", "##s", "un", "##aff", "##able", "cafe", "[UNK]"]
        assert tokenizer.detokenize(ids[:4]) == "hello , worlds"
    else:
        assert pieces == ["Hello", ",", "world", "##s", "un", "##aff", "##able", "[UNK]",
                          "[UNK]"]


def test_build_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-model: file not found: .*nope.model"):
        build_tokenizer(argparse.Namespace(tokenizer_type="SentencePieceTokenizer",
                                           tokenizer_model=str(tmp_path / "nope.model")))
    with pytest.raises(ValueError, match="--tokenizer-model is required"):
        build_tokenizer(argparse.Namespace(tokenizer_type="SentencePieceTokenizer"))
    with pytest.raises(ValueError, match="--tokenizer-type: unsupported value 'SFTTokenizer'"):
        build_tokenizer(argparse.Namespace(tokenizer_type="SFTTokenizer"))
    (tmp_path / "vocab.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="--merge-file: file not found"):
        build_tokenizer(argparse.Namespace(tokenizer_type="GPT2BPETokenizer",
                                           vocab_file=str(tmp_path / "vocab.json"),
                                           merge_file=str(tmp_path / "merges.txt")))
    with pytest.raises(ValueError, match="--vocab-file: file not found"):
        build_tokenizer(argparse.Namespace(tokenizer_type="BertWordPieceCase",
                                           vocab_file=str(tmp_path / "vocab.txt")))
    (tmp_path / "vocab.txt").write_text("[PAD]\nhello\n", encoding="utf-8")
    with pytest.raises(ValueError, match="--vocab-file: .* lacks"):
        build_tokenizer(argparse.Namespace(tokenizer_type="BertWordPieceCase",
                                           vocab_file=str(tmp_path / "vocab.txt")))


def _write_hf_tokenizer(directory, lines, special_tokens, config=None):
    """A byte-level BPE tokenizer.json trained on LINES (the `tokenizers` library's own
    trainer) whose post-processor adds <s> ... </s>, plus one added non-special token, and
    CONFIG as tokenizer_config.json; returns the `tokenizers.Tokenizer`."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if "<s>" in special_tokens and "</s>" in special_tokens:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[(t, tokenizer.token_to_id(t))
                                                  for t in ("<s>", "</s>")])
    tokenizer.add_tokens(["<extra_0>"])  # counts in the vocabulary, beyond the BPE model's
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tokenizer


def _hf_args(directory):
    return argparse.Namespace(tokenizer_type="HuggingFaceTokenizer",
                              tokenizer_model=str(directory))


def test_huggingface_tokenizer_from_local_directory(tmp_path, documents):
    directory = tmp_path / "hf"
    reference = _write_hf_tokenizer(
        directory, documents[:50], ["<pad>", "<s>", "</s>", "<unk>"],
        config={"eos_token": {"content": "</s>", "special": True}, "bos_token": "<s>",
                "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 1024})
    tokenizer = build_tokenizer(_hf_args(directory))
    assert isinstance(tokenizer, MegatronTokenizerBase)
    assert tokenizer.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    assert tokenizer.vocab_size == reference.get_vocab_size(with_added_tokens=False) + 1
    assert (tokenizer.pad, tokenizer.bos, tokenizer.eod, tokenizer.unk) == (0, 1, 2, 3)
    assert tokenizer.inv_vocab[tokenizer.eod] == "</s>" and tokenizer.vocab["<extra_0>"] > 3
    _assert_round_trips(tokenizer, [ROUND_TRIP_TEXT, ROUND_TRIP_TEXT + " <extra_0>",
                                    *documents[:50]])
    # The tokenizer's post-processor adds <s> ... </s>; tokenize leaves them out.
    assert reference.encode("hello").ids[0] == tokenizer.bos
    assert tokenizer.tokenize("hello") == reference.encode("hello", add_special_tokens=False).ids
    assert not {tokenizer.bos, tokenizer.eod} & set(tokenizer.tokenize(documents[0]))
    assert not tokenizer.has_bert_special_tokens()  # no cls / sep / mask configured


def test_planner_reads_the_huggingface_vocabulary_size(tmp_path, documents):
    from megatron_parm.planner_inputs import vocab_size_of

    reference = _write_hf_tokenizer(tmp_path / "hf", documents[:20], ["</s>"])
    settings = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tmp_path / "hf")}
    assert vocab_size_of(settings) == reference.get_vocab_size(with_added_tokens=True)
    settings["tokenizer_model"] = str(tmp_path)
    with pytest.raises(ValueError, match=r"^--tokenizer-model: no tokenizer.json in .* \(or give "
                                         r"--vocab-size\)$"):
        vocab_size_of(settings)


def test_huggingface_tokenizer_end_of_document_without_config(tmp_path, documents):
    _write_hf_tokenizer(tmp_path / "gpt", documents[:20], ["<|endoftext|>"])
    tokenizer = build_tokenizer(_hf_args(tmp_path / "gpt"))
    assert tokenizer.inv_vocab[tokenizer.eod] == "<|endoftext|>"
    with pytest.raises(AttributeError):
        tokenizer.pad  # noqa: B018 (no pad_token: Megatron-Core's datasets use their own)
    _write_hf_tokenizer(tmp_path / "none", documents[:20], ["<unk>"])
    with pytest.raises(ValueError, match=r"^--tokenizer-model: .*none has no end-of-document "
                                         r"token: name an eos_token in its tokenizer_config"):
        build_tokenizer(_hf_args(tmp_path / "none"))


def test_huggingface_tokenizer_errors_name_the_flag(tmp_path, documents, monkeypatch):
    with pytest.raises(ValueError, match="^--tokenizer-model is required with --tokenizer-type "
                                         "HuggingFaceTokenizer"):
        build_tokenizer(argparse.Namespace(tokenizer_type="HuggingFaceTokenizer"))
    with pytest.raises(ValueError, match="^--tokenizer-model: not a directory: .*missing"):
        build_tokenizer(_hf_args(tmp_path / "missing"))
    (tmp_path / "tokenizer.model").write_text("not a directory")
    with pytest.raises(ValueError, match="^--tokenizer-model: not a directory"):
        build_tokenizer(_hf_args(tmp_path / "tokenizer.model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="^--tokenizer-model: no tokenizer.json in .*empty$"):
        build_tokenizer(_hf_args(tmp_path / "empty"))
    (tmp_path / "empty" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="^--tokenizer-model: .*tokenizer.json is not a "
                                         "Hugging Face tokenizer"):
        build_tokenizer(_hf_args(tmp_path / "empty"))
    _write_hf_tokenizer(tmp_path / "hf", documents[:20], ["</s>"], config={"eos_token": "<eos>"})
    with pytest.raises(ValueError, match="^--tokenizer-model: eos_token '<eos>' of .* is not "
                                         "in its tokenizer.json"):
        build_tokenizer(_hf_args(tmp_path / "hf"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"^--tokenizer-type HuggingFaceTokenizer needs the "
                                         r"'tokenizers' package \(pip install tokenizers\)$"):
        build_tokenizer(_hf_args(tmp_path / "hf"))


def test_train_tokenizer_tool(tmp_path, documents):
    jsonl = tmp_path / "small.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents[:100]),
                     encoding="utf-8")
    load_tool("train_tokenizer").main([
        "--input", str(jsonl), "--vocab-size", "600", "--output-prefix", str(tmp_path / "sp"),
        "--num-threads", "1"])
    assert (tmp_path / "sp.vocab").is_file()
    tokenizer = build_tokenizer(argparse.Namespace(tokenizer_type="SentencePieceTokenizer",
                                                   tokenizer_model=str(tmp_path / "sp.model")))
    assert tokenizer.vocab_size == 600 and tokenizer.has_bert_special_tokens()
    assert tokenizer.detokenize(tokenizer.tokenize(documents[0])) == documents[0]
    with pytest.raises(ValueError, match="--input: file not found"):
        load_tool("train_tokenizer").main([
            "--input", str(tmp_path / "missing.jsonl"), "--vocab-size", "600",
            "--output-prefix", str(tmp_path / "sp2")])
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "a tiny corpus"}) + "\n")
    with pytest.raises(ValueError, match=r"^--vocab-size 600 is more pieces than the input "
                                         r"holds: give --vocab-size \d+ or less"):
        load_tool("train_tokenizer").main([
            "--input", str(tmp_path / "one.jsonl"), "--vocab-size", "600",
            "--output-prefix", str(tmp_path / "sp3"), "--num-threads", "1"])


# ---------------------------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------------------------

def test_split_sentences():
    text = ("See e.g. the docs. It works, i.e. fine! Dr. Who said \"Hi.\" Then J. Smith "
            "left.\nVersion 3.11 is out.\n\nNew paragraph without a period")
    assert split_sentences(text) == [
        "See e.g. the docs.", "It works, i.e. fine!", "Dr. Who said \"Hi.\"",
        "Then J. Smith left.", "Version 3.11 is out.", "New paragraph without a period"]
    assert split_sentences("") == []


def test_preprocess_gpt_documents(data_dir, documents, spm_tokenizer):
    prefix = data_dir / "gpt_text_document"
    assert prefix.with_suffix(".bin").is_file() and prefix.with_suffix(".idx").is_file()
    dataset = IndexedDataset(str(prefix))
    assert dataset.index.dtype == numpy.uint16  # Megatron's choice for a vocab under 65500
    assert len(dataset) == len(documents)  # the empty document was skipped
    assert len(dataset.document_indices) == len(documents) + 1
    for i in (0, 7, len(documents) - 1):
        ids = dataset[i].tolist()
        assert ids[-1] == spm_tokenizer.eod
        assert spm_tokenizer.detokenize(ids[:-1]) == documents[i]


def test_preprocess_bert_sentences(data_dir, documents, spm_tokenizer):
    dataset = IndexedDataset(str(data_dir / "bert_text_sentence"))
    num_sentences = numpy.diff(dataset.document_indices)
    assert len(num_sentences) == len(documents)
    for i in (0, 5):
        expected = split_sentences(documents[i])
        assert num_sentences[i] == len(expected)
        first = dataset[int(dataset.document_indices[i])].tolist()
        assert spm_tokenizer.detokenize(first) == expected[0]
        assert spm_tokenizer.eod not in first  # no --append-eod


def test_preprocess_tool_cli_and_workers(data_dir, tmp_path):
    tool = load_tool("preprocess_data")
    common = ["--input", str(data_dir / "tiny.jsonl"), "--tokenizer-type",
              "SentencePieceTokenizer", "--tokenizer-model", str(SPM_MODEL), "--append-eod",
              "--json-keys", "text", "title"]
    tool.main(common + ["--output-prefix", str(tmp_path / "cli"), "--workers", "2"])
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"cli_text_document{suffix}").read_bytes() == \
            (data_dir / f"gpt_text_document{suffix}").read_bytes()
    titles = IndexedDataset(str(tmp_path / "cli_title_document"))
    assert len(titles) == NUM_DOCS + 1  # the empty document has a title
    with pytest.raises(ValueError, match="--tokenizer-model: file not found"):
        tool.main(["--input", str(data_dir / "tiny.jsonl"), "--output-prefix",
                   str(tmp_path / "x"), "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", str(tmp_path / "missing.model")])
    with pytest.raises(ValueError, match="--input: file not found"):
        tool.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix",
                   str(tmp_path / "x"), "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", str(SPM_MODEL)])
    with pytest.raises(ValueError, match="--json-keys: line 1 has no key 'body'"):
        tool.main(common[:-2] + ["body", "--output-prefix", str(tmp_path / "y")])


def test_preprocess_tool_with_huggingface_tokenizer(data_dir, documents, tmp_path):
    directory = tmp_path / "hf"
    _write_hf_tokenizer(directory, documents[:50], ["<|endoftext|>", "</s>"],
                        config={"eos_token": "</s>"})
    tokenizer = build_tokenizer(_hf_args(directory))
    load_tool("preprocess_data").main([
        "--input", str(data_dir / "tiny.jsonl"), "--output-prefix", str(tmp_path / "hf_data"),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(directory),
        "--append-eod"])
    dataset = IndexedDataset(str(tmp_path / "hf_data_text_document"))
    assert dataset.index.dtype == numpy.uint16 and len(dataset) == len(documents)
    for i in (0, 7, len(documents) - 1):
        ids = dataset[i].tolist()
        assert ids[-1] == tokenizer.eod == tokenizer.vocab["</s>"]
        assert tokenizer.eod not in ids[:-1]
        assert tokenizer.detokenize(ids[:-1]) == documents[i]
    # Megatron-Core's GPT dataset reads it with this tokenizer.
    train = build_gpt_datasets(tokenizer, [str(tmp_path / "hf_data_text_document")], "1,0,0",
                               32, 1234, [8, None, None],
                               data_cache_path=str(tmp_path / "cache"))[0]
    tokens = next(build_data_iterator(train, 4))["tokens"]
    assert tokens.shape == (4, 32) and int(tokens.max()) < tokenizer.vocab_size
    with pytest.raises(ValueError, match="--tokenizer-model: no tokenizer.json in"):
        load_tool("preprocess_data").main([
            "--input", str(data_dir / "tiny.jsonl"), "--output-prefix", str(tmp_path / "x"),
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# Datasets and iterators
# ---------------------------------------------------------------------------------------------

def test_gpt_datasets_and_batches(data_dir, spm_tokenizer, tmp_path):
    seq_length, micro_batch_size = 64, 4
    num_samples = train_valid_test_num_samples(train_iters=20, global_batch_size=8,
                                               eval_interval=10, eval_iters=2)
    assert num_samples == [160, 48, 16]
    train, valid, test = build_gpt_datasets(
        spm_tokenizer, [str(data_dir / "gpt_text_document")], "90,8,2", seq_length, 1234,
        num_samples, data_cache_path=str(tmp_path / "cache"), eod_mask_loss=True)
    assert len(train) >= 160 and len(valid) >= 48 and len(test) >= 16
    batch = next(build_data_iterator(train, micro_batch_size))
    assert batch["tokens"].shape == (micro_batch_size, seq_length)
    assert batch["attention_mask"].shape == (micro_batch_size, 1, seq_length, seq_length)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"][0], torch.arange(seq_length))
    # --eod-mask-loss: no loss where the input token is the end of a document.
    eod = batch["tokens"] == spm_tokenizer.eod
    assert torch.all(batch["loss_mask"][eod] == 0) and torch.all(batch["loss_mask"][~eod] == 1)
    # Same seed, same samples; the second build reads the cache.
    again = build_gpt_datasets(
        spm_tokenizer, [str(data_dir / "gpt_text_document")], "90,8,2", seq_length, 1234,
        num_samples, data_cache_path=str(tmp_path / "cache"), eod_mask_loss=True)[0]
    assert torch.equal(again[3]["tokens"], train[3]["tokens"])
    # A weighted blend of two prefixes.
    blend = build_gpt_datasets(
        spm_tokenizer, ["0.3", str(data_dir / "gpt_text_document"), "0.7",
                        str(data_dir / "gpt_text_document")],
        "98,2,0", seq_length, 1, [32, 8, None], data_cache_path=str(tmp_path / "cache"))
    assert len(blend[0]) >= 32 and blend[2] is None  # Megatron rounds blends up a little
    assert set(blend[0][0]) >= {"tokens", "labels", "dataset_id"}


def test_bert_datasets_and_batches(data_dir, spm_tokenizer, tmp_path):
    seq_length, micro_batch_size = 64, 8
    train, valid, test = build_bert_datasets(
        spm_tokenizer, [str(data_dir / "bert_text_sentence")], "90,8,2", seq_length, 1234,
        [200, 20, 10], data_cache_path=str(tmp_path / "cache"))
    assert not torch.distributed.is_initialized()  # the temporary group is gone again
    # Megatron-Core builds whole epochs, so counts are lower bounds.
    assert len(train) >= 200 and len(valid) >= 20 and len(test) >= 10
    batch = next(build_data_iterator(train, micro_batch_size))
    for key in ("text", "types", "labels", "loss_mask", "padding_mask"):
        assert batch[key].shape == (micro_batch_size, seq_length), key
    assert batch["is_random"].shape == (micro_batch_size,)
    assert set(batch["is_random"].tolist()) <= {0, 1}
    assert torch.all(batch["text"][:, 0] == spm_tokenizer.cls)
    for row in range(micro_batch_size):
        num_real = int(batch["padding_mask"][row].sum())
        assert torch.all(batch["padding_mask"][row, :num_real] == 1)
        assert torch.all(batch["padding_mask"][row, num_real:] == 0)
        assert int((batch["text"][row, :num_real] == spm_tokenizer.sep).sum()) == 2
        assert torch.all(batch["types"][row, num_real:] == 0)
        # Loss exactly where a label is given; about 15% of the real tokens.
        masked = batch["loss_mask"][row] > 0
        assert torch.equal(masked, batch["labels"][row] >= 0)
        assert 1 <= int(masked.sum()) <= max(1, round(0.15 * num_real)) + 1
        assert not torch.any(masked[num_real:])
    assert batch["loss_mask"].dtype == torch.float32
    # Without the next-sentence head every sample is a single segment.
    single = build_bert_datasets(
        spm_tokenizer, [str(data_dir / "bert_text_sentence")], "1,0,0", seq_length, 5,
        [16, None, None], data_cache_path=str(tmp_path / "cache"), binary_head=False)[0]
    assert int(single[0]["is_random"]) == 0 and int(single[0]["types"].max()) == 0


def test_batch_sampler_data_parallel_and_resume():
    ranks = [list(PretrainingBatchSampler(20, 0, 2, rank, 3)) for rank in range(3)]
    assert ranks[0][:2] == [[0, 1], [6, 7]] and ranks[2][0] == [4, 5]
    assert len(ranks[0]) == 3  # 18 of 20 samples fill whole steps
    flat = sorted(i for rank in ranks for batch in rank for i in batch)
    assert flat == list(range(18))
    assert list(PretrainingBatchSampler(20, 12, 2, 1, 3)) == [[14, 15]]


def test_iterators_leave_torch_rng_alone():
    """Starting an iterator (lazily, at its first batch; again at each pass of a cyclic one)
    draws no number from torch's global generator, dropout's on CPU: a run resumed from a
    checkpoint starts its iterator after restoring the RNG states, the uninterrupted one
    long before (a bitwise resume at tp=1)."""
    samples = [{"tokens": torch.tensor([i])} for i in range(6)]
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    iterator = build_data_iterator(samples, 2, cyclic=True)
    batches = [next(iterator)["tokens"].flatten().tolist() for _ in range(4)]  # two passes
    assert batches == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert torch.equal(torch.rand(3), expected)


def test_data_errors_name_the_flag(data_dir, spm_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"--data-path: no such indexed dataset: .*missing "
                                         r"\(.bin/.idx not found; build it with "):
        parse_data_path([str(tmp_path / "missing")])
    prefix = str(data_dir / "gpt_text_document")
    assert parse_data_path(prefix) == ([prefix], None)
    assert parse_data_path([prefix, prefix]) == ([prefix, prefix], None)
    assert parse_data_path(["1", prefix, "3", prefix]) == ([prefix, prefix], [1.0, 3.0])
    with pytest.raises(ValueError, match="--data-path: no such indexed dataset: 0.5"):
        parse_data_path([prefix, "0.5"])
    with pytest.raises(ValueError, match="--data-path is required"):
        parse_data_path([])
    with pytest.raises(ValueError, match="--split"):
        parse_split("90/10")
    with pytest.raises(ValueError, match="--split"):
        parse_split("0,0,0")
    assert parse_split("969,30,1")[2][1] == pytest.approx(1.0)
    # 1/1000 of 300 documents rounds to none: refuse instead of looping forever.
    with pytest.raises(ValueError, match="--split: the test split .* has no sequences"):
        build_gpt_datasets(spm_tokenizer, [str(data_dir / "gpt_text_document")], "999,0,1",
                           32, 1, [8, 8, 8], data_cache_path=str(tmp_path / "cache"))
    gpt2_like = argparse.Namespace(**SPM_ARGS)
    tokenizer = build_tokenizer(gpt2_like)
    tokenizer.has_bert_special_tokens = lambda: False
    with pytest.raises(ValueError, match="--tokenizer-type SentencePieceTokenizer: BERT needs"):
        build_bert_datasets(tokenizer, [str(data_dir / "bert_text_sentence")], "1,0,0", 32, 1,
                            [8, None, None], data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="--data-path: no such indexed dataset"):
        build_bert_datasets(spm_tokenizer, [str(data_dir / "bert")], "1,0,0", 32, 1,
                            [8, None, None], data_cache_path=str(tmp_path / "cache"))


# ---------------------------------------------------------------------------------------------
# Megatron-LM's other tokenizer types and flags
# ---------------------------------------------------------------------------------------------

def test_sentencepiece_types_and_legacy_special_tokens(spm_tokenizer):
    """GPTSentencePieceTokenizer and Llama2Tokenizer are the SentencePieceTokenizer's ids
    (Megatron-Core builds all three with its SentencePiece library); legacy mode adds
    --tokenizer-special-tokens after the model's pieces, and only legacy mode takes them."""
    text = "Return x.\n\thello world"
    for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tokenizer = build_tokenizer(argparse.Namespace(**{**SPM_ARGS, "tokenizer_type": kind}))
        assert tokenizer.tokenize(text) == spm_tokenizer.tokenize(text)
        assert (tokenizer.vocab_size, tokenizer.eod) == (8000, spm_tokenizer.eod)
    legacy = build_tokenizer(argparse.Namespace(**SPM_ARGS, tokenizer_sentencepiece_legacy=True,
                                                tokenizer_special_tokens=["<tool>", "[CLS]"]))
    assert legacy.vocab_size == 8001 and legacy.inv_vocab[8000] == "<tool>"
    assert 8000 in legacy.tokenize("hello <tool> world") and legacy.cls == spm_tokenizer.cls
    with pytest.raises(ValueError, match="^--tokenizer-special-tokens: --tokenizer-type "
                                         "SentencePieceTokenizer takes them with "
                                         "--tokenizer-sentencepiece-legacy only"):
        build_tokenizer(argparse.Namespace(**SPM_ARGS, tokenizer_special_tokens=["<tool>"]))


def test_null_tokenizer_and_mock_gpt_data(tmp_path):
    """--tokenizer-type NullTokenizer --vocab-size N: text is its ids, the end of a document
    is N (a vocabulary of N + 1); --mock-data: Megatron-Core's MockGPTDataset, no files."""
    from megatron_parm.data.datasets import MOCK_BERT

    tokenizer = build_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=50))
    assert (tokenizer.vocab_size, tokenizer.eod) == (51, 50)
    assert tokenizer.tokenize("3 1 4") == [3, 1, 4] and tokenizer.detokenize([3, 1]) == "3 1"
    assert not tokenizer.has_bert_special_tokens()
    train, valid, test = build_gpt_datasets(tokenizer, (None, None), None, 32, 1, [16, 8, 8])
    assert len(train) >= 16 and len(valid) >= 8 and len(test) >= 8
    tokens = torch.stack([train[i]["tokens"] for i in range(16)])
    assert int(tokens.max()) <= 50 and bool((tokens == 50).any())  # documents end with EOD
    with pytest.raises(ValueError, match=r"^--vocab-size is required with --tokenizer-type "
                                         r"NullTokenizer$"):
        build_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer"))
    with pytest.raises(ValueError, match=re.escape(MOCK_BERT)):
        build_bert_datasets(tokenizer, (None, None), None, 32, 1, [8, 8, 8])


def _write_tiktoken_vocab(path, merges=(b"he", b"ll", b"hell", b"hello", b" w", b" wo")):
    """A tiktoken vocabulary as Megatron-Core reads it: a JSON list of {rank, token_bytes,
    token_str}, the 256 bytes first."""
    import base64

    tokens = [bytes([i]) for i in range(256)] + list(merges)
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("latin-1")} for i, t in enumerate(tokens)]))
    return len(tokens)


def test_tiktokenizer_from_a_local_vocabulary(tmp_path):
    pytest.importorskip("tiktoken")
    num_entries = _write_tiktoken_vocab(tmp_path / "vocab.json")
    args = dict(tokenizer_type="TikTokenizer", tokenizer_model=str(tmp_path / "vocab.json"),
                vocab_size=num_entries + 16, tiktoken_num_special_tokens=16,
                tiktoken_pattern="v2")
    tokenizer = build_tokenizer(argparse.Namespace(**args))
    # Megatron-Core's default special tokens first: <unk> <s> </s> <mask> <pad> <cls> <sep>
    assert tokenizer.vocab_size == num_entries + 16
    assert (tokenizer.eod, tokenizer.pad, tokenizer.cls, tokenizer.sep) == (2, 4, 5, 6)
    ids = tokenizer.tokenize("hello world")
    assert ids[0] == 16 + 256 + 3 and tokenizer.detokenize(ids) == "hello world"  # 'hello'
    special = build_tokenizer(argparse.Namespace(**args, tokenizer_special_tokens=[
        "<pad>", "<unk>", "<s>", "</s>", "<mask>", "<cls>", "<sep>", "<tool>"]))
    assert (special.pad, special.eod) == (0, 3)
    with pytest.raises(ValueError, match=r"^--vocab-size 1000 needs 984 entries in "
                                         r"--tokenizer-model .* it has 262"):
        build_tokenizer(argparse.Namespace(**{**args, "vocab_size": 1000}))
    with pytest.raises(ValueError, match="^--tokenizer-special-tokens: TikTokenizer's must "
                                         r"include .*\(missing </s>, <mask>, <pad>, <cls>, "
                                         r"<sep>\)$"):
        build_tokenizer(argparse.Namespace(**args, tokenizer_special_tokens=["<unk>", "<s>"]))


def test_huggingface_and_wordpiece_special_token_flags(tmp_path, documents):
    """--tokenizer-hf-include-special-tokens: the tokenizer's own framing (its post-processor's
    <s> ... </s>; BERT's [CLS] ... [SEP]); --tokenizer-special-tokens: added to a Hugging Face
    vocabulary that lacks them."""
    directory = tmp_path / "hf"
    _write_hf_tokenizer(directory, documents[:20], ["<pad>", "<s>", "</s>"],
                        config={"eos_token": "</s>", "bos_token": "<s>"})
    plain = build_tokenizer(_hf_args(directory))
    framed = build_tokenizer(argparse.Namespace(**vars(_hf_args(directory)),
                                                tokenizer_hf_include_special_tokens=True))
    assert framed.tokenize("hello") == [plain.bos, *plain.tokenize("hello"), plain.eod]
    extended = build_tokenizer(argparse.Namespace(**vars(_hf_args(directory)),
                                                  tokenizer_special_tokens=["<tool>"]))
    assert extended.vocab_size == plain.vocab_size + 1
    assert extended.tokenize("a <tool>")[-1] == extended.vocab["<tool>"] == plain.vocab_size
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    bert = build_tokenizer(argparse.Namespace(tokenizer_type="BertWordPieceCase",
                                              vocab_file=str(tmp_path / "vocab.txt"),
                                              tokenizer_hf_include_special_tokens=True))
    assert bert.tokenize("hello") == [2, 5, 3]
    with pytest.raises(ValueError, match="^--tokenizer-special-tokens: not taken by "
                                         "--tokenizer-type BertWordPieceCase"):
        build_tokenizer(argparse.Namespace(tokenizer_type="BertWordPieceCase",
                                           vocab_file=str(tmp_path / "vocab.txt"),
                                           tokenizer_special_tokens=["<tool>"]))


def test_model_vocabulary_padding_flags():
    """--make-vocab-size-divisible-by x TP (Megatron-LM's rule), --padded-vocab-size as given,
    --vocab-extra-ids where Megatron-LM's tokenizer for the model adds them, and a resumed
    checkpoint's padding kept."""
    from megatron_parm.data.vocab import model_vocab_sizes, padded_vocab_size

    def flags(**values):
        base = dict(tokenizer_type="GPT2BPETokenizer", tensor_model_parallel_size=2,
                    make_vocab_size_divisible_by=128, padded_vocab_size=None, vocab_extra_ids=0)
        return argparse.Namespace(**{**base, **values})

    assert padded_vocab_size(1101, 2) == 1280 and padded_vocab_size(1101, 2, 64) == 1152
    assert model_vocab_sizes(50257, flags()) == (50257, 50432)
    assert model_vocab_sizes(50257, flags(make_vocab_size_divisible_by=1)) == (50257, 50258)
    assert model_vocab_sizes(50257, flags(padded_vocab_size=50260)) == (50257, 50260)
    assert model_vocab_sizes(8000, flags(tokenizer_type="SentencePieceTokenizer",
                                         vocab_extra_ids=100)) == (8100, 8192)
    assert model_vocab_sizes(8000, flags(vocab_extra_ids=100)) == (8000, 8192)  # GPT-2: none
    assert model_vocab_sizes(8000, flags(), checkpoint_padded=8064) == (8000, 8064)
    with pytest.raises(ValueError, match=r"^--padded-vocab-size 8000 is smaller than the "
                                         r"vocabulary \(8100 tokens"):
        model_vocab_sizes(8000, flags(tokenizer_type="BertWordPieceCase", vocab_extra_ids=100,
                                      padded_vocab_size=8000))
    with pytest.raises(ValueError, match="^--padded-vocab-size 8001 must be divisible by "
                                         "--tensor-model-parallel-size 2$"):
        model_vocab_sizes(8000, flags(padded_vocab_size=8001))
    with pytest.raises(ValueError, match="^--padded-vocab-size 8192: the checkpoint being "
                                         "loaded has a vocabulary of 8064$"):
        model_vocab_sizes(8000, flags(padded_vocab_size=8192), checkpoint_padded=8064)


# ---------------------------------------------------------------------------------------------
# Megatron-LM's other data flags
# ---------------------------------------------------------------------------------------------

def _gpt(tokenizer, data, tmp_path, **kwargs):
    return build_gpt_datasets(tokenizer, data, kwargs.pop("split", "90,8,2"), 32, 7,
                              kwargs.pop("num_samples", [16, 8, 4]),
                              data_cache_path=kwargs.pop("cache", str(tmp_path / "cache")),
                              **kwargs)


def test_gpt_samples_without_mask_or_mmap_and_where_caches_go(data_dir, spm_tokenizer, tmp_path):
    """--no-create-attention-mask-in-dataloader: no mask in the sample, the rest the same;
    --no-mmap-bin-files: Megatron-Core reads the .bin with file reads, the same samples;
    --data-cache-path: the indexes there, else under PREFIX/cache/ (Megatron-Core's default)."""
    from megatron.core.datasets.indexed_dataset import _FileBinReader, _MMapBinReader

    prefix = [str(data_dir / "gpt_text_document")]
    reference = _gpt(spm_tokenizer, prefix, tmp_path)[0]
    assert isinstance(reference.dataset.bin_reader, _MMapBinReader)
    no_mask = _gpt(spm_tokenizer, prefix, tmp_path, create_attention_mask=False)[0]
    no_mmap = _gpt(spm_tokenizer, prefix, tmp_path, mmap_bin_files=False)[0]
    assert isinstance(no_mmap.dataset.bin_reader, _FileBinReader)
    for i in (0, 5):
        assert "attention_mask" in reference[i] and "attention_mask" not in no_mask[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(no_mask[i][key], reference[i][key])
            assert torch.equal(no_mmap[i][key], reference[i][key])
    assert sorted(p.name.split("-", 1)[1] for p in (tmp_path / "cache").glob("*GPTDataset-train*")) \
        == ["GPTDataset-train-description.txt", "GPTDataset-train-document_index.npy",
            "GPTDataset-train-sample_index.npy", "GPTDataset-train-shuffle_index.npy"]
    copy = tmp_path / "copy"
    copy.mkdir()
    for suffix in (".bin", ".idx"):
        (copy / f"gpt{suffix}").write_bytes((data_dir / f"gpt_text_document{suffix}").read_bytes())
    _gpt(spm_tokenizer, [str(copy / "gpt")], tmp_path, cache=None)
    assert list((copy / "gpt" / "cache" / "GPTDataset_indices").glob("*-GPTDataset-train-*"))


def test_per_split_data_paths_and_files_that_hold_them(data_dir, spm_tokenizer, tmp_path):
    """--train/valid/test-data-path: each split from its own datasets, whole; the same read
    from --per-split-data-args-path, and --data-path from --data-args-path; a split without
    data is None."""
    from megatron_parm.data.datasets import data_sources

    gpt, bert = str(data_dir / "gpt_text_document"), str(data_dir / "bert_text_sentence")

    def args(**values):
        base = dict(data_path=None, data_args_path=None, train_data_path=None,
                    valid_data_path=None, test_data_path=None, per_split_data_args_path=None,
                    mock_data=False)
        return argparse.Namespace(**{**base, **values})

    source = data_sources(args(train_data_path=[gpt], valid_data_path=["1", gpt, "1", bert]))
    assert source == (None, [([gpt], None), ([gpt, bert], [1.0, 1.0]), None])
    train, valid, test = _gpt(spm_tokenizer, source, tmp_path, split=None)
    assert test is None and len(train) >= 16 and len(valid) >= 8
    whole = _gpt(spm_tokenizer, [gpt], tmp_path, split="1,0,0")[0]
    assert torch.equal(train[3]["tokens"], whole[3]["tokens"])  # the whole dataset, same seed
    assert {int(valid[i]["dataset_id"]) for i in range(8)} == {0, 1}
    (tmp_path / "split.json").write_text(json.dumps({"train": gpt, "valid": f"1 {gpt} 1 {bert}",
                                                     "test": None}))
    assert data_sources(args(per_split_data_args_path=str(tmp_path / "split.json"))) == source
    (tmp_path / "blend.txt").write_text(f"0.3 {gpt}\n0.7 {gpt}\n")
    assert data_sources(args(data_args_path=str(tmp_path / "blend.txt"))) == (
        ([gpt, gpt], [0.3, 0.7]), None)
    with pytest.raises(ValueError, match=r"^--mock-data and --data-path: give a single data "
                                         r"source"):
        data_sources(args(mock_data=True, data_path=[gpt]))
    with pytest.raises(ValueError, match=r"^--data-path is required .*or --mock-data$"):
        data_sources(args(data_path=[""]))
    with pytest.raises(ValueError, match="^--valid-data-path: no such indexed dataset"):
        data_sources(args(valid_data_path=[str(tmp_path / "missing")]))
    (tmp_path / "bad.json").write_text(json.dumps({"train": gpt}))
    with pytest.raises(ValueError, match="^--per-split-data-args-path: .* needs the keys train, "
                                         "valid and test \\(missing valid, test\\)$"):
        data_sources(args(per_split_data_args_path=str(tmp_path / "bad.json")))


def test_sequences_per_dataset_and_blend_surplus(data_dir, spm_tokenizer, tmp_path):
    """--per-dataset-sequences-path: Megatron-Core takes the counts from the file instead of the
    .idx header (the true counts, as Megatron-LM's tools/build_sequences_per_dataset.py writes
    them: the same samples);
    --mid-level-dataset-surplus: the extra share each dataset of a weighted blend builds."""
    prefix = str(data_dir / "gpt_text_document")
    full = IndexedDataset(prefix)
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({prefix: [len(full), len(full.document_indices)]}))
    reference = _gpt(spm_tokenizer, [prefix], tmp_path, split="1,0,0", num_samples=[16, 0, 0])[0]
    same = _gpt(spm_tokenizer, [prefix], tmp_path, split="1,0,0", num_samples=[16, 0, 0],
                sequences_per_dataset_path=str(counts))[0]
    assert torch.equal(same[3]["tokens"], reference[3]["tokens"])
    assert same.dataset.sequences_per_dataset == (len(full), len(full.document_indices))
    assert reference.dataset.sequences_per_dataset is None  # read from the header
    counts.write_text(json.dumps({"other": [1, 1]}))
    with pytest.raises(ValueError, match="^--per-dataset-sequences-path: .* has no \\[sequences, "
                                         "documents\\] for .*gpt_text_document$"):
        _gpt(spm_tokenizer, [prefix], tmp_path, sequences_per_dataset_path=str(counts))
    blend = ["1", prefix, "1", prefix]
    surplus = _gpt(spm_tokenizer, blend, tmp_path, split="1,0,0", num_samples=[1000, 0, 0],
                   mid_level_dataset_surplus=0.5)[0]
    default = _gpt(spm_tokenizer, blend, tmp_path, split="1,0,0", num_samples=[1000, 0, 0])[0]
    assert [d.num_samples for d in surplus.datasets] == [750, 750]  # 500 x 1.5
    assert [d.num_samples for d in default.datasets] == [503, 503]  # 500 x 1.005, rounded up


def test_ambiguous_pad_tokens(data_dir, spm_tokenizer, tmp_path):
    """A tokenizer whose padding id is also its end-of-document id: by default Megatron-Core
    masks no loss for it; --allow-ambiguous-pad-tokens masks the loss where the label is that
    id."""
    tokenizer = build_tokenizer(argparse.Namespace(**SPM_ARGS))
    tokenizer.__class__ = type("PadIsEod", (type(tokenizer),),
                               {"pad": property(lambda self: self.eod)})
    prefix = [str(data_dir / "gpt_text_document")]
    plain = _gpt(tokenizer, prefix, tmp_path)[0]
    allowed = _gpt(tokenizer, prefix, tmp_path, allow_ambiguous_pad_tokens=True)[0]
    sample = next(i for i in range(len(plain)) if (plain[i]["labels"] == tokenizer.eod).any())
    at_eod = plain[sample]["labels"] == tokenizer.eod
    assert torch.all(plain[sample]["loss_mask"] == 1)
    assert torch.all(allowed[sample]["loss_mask"][at_eod] == 0)
    assert torch.all(allowed[sample]["loss_mask"][~at_eod] == 1)


def test_random_batch_sampler_epochs_shards_and_resume():
    """--dataloader-type cyclic: each data-parallel rank draws its own share of an epoch in a
    random order (seeded by the epoch), whole steps only; the next pass is the next epoch, and
    a sampler made at consumed samples goes on where the first one was."""
    from megatron_parm.data.loaders import RandomBatchSampler

    samplers = [RandomBatchSampler(21, 0, 2, rank, 2) for rank in range(2)]
    epoch0 = [list(sampler) for sampler in samplers]
    assert [len(batches) for batches in epoch0] == [5, 5]  # 20 of 21 samples: 5 steps of 4
    assert sorted(i for batch in epoch0[0] for i in batch) == list(range(10))
    assert sorted(i for batch in epoch0[1] for i in batch) == list(range(10, 20))
    assert [i for batch in epoch0[0] for i in batch] != list(range(10))  # shuffled
    epoch1 = list(samplers[0])
    assert sorted(i for batch in epoch1 for i in batch) == list(range(10)) and epoch1 != epoch0[0]
    resumed = RandomBatchSampler(21, 12, 2, 0, 2)  # 3 steps in
    assert list(resumed) == epoch0[0][3:]
    assert list(RandomBatchSampler(21, 28, 2, 0, 2)) == epoch1[2:]


def test_phases_and_where_iterators_resume():
    """--phase-transition-iterations: a phase's datasets cover its own samples and are read
    from their start; the run stops after a transition; validation resumes after the
    evaluations already run (Megatron-LM's count)."""
    from megatron_parm.data.loaders import (
        check_phase_resume, consumed_validation_samples, phase_start, phase_transition_at)

    args = argparse.Namespace(train_iters=100, global_batch_size=8, eval_interval=10,
                              eval_iters=2, skip_train=False,
                              phase_transition_iterations=[30, 60])
    assert [phase_start(args, it) for it in (0, 29, 30, 59, 60, 99)] == [
        (0, 240), (0, 240), (30, 240), (30, 240), (60, 320), (60, 320)]
    assert [it for it in range(1, 101) if phase_transition_at(it, args)] == [30, 60]
    check_phase_resume({"global_batch_size": 8}, args)
    with pytest.raises(ValueError, match="^--phase-transition-iterations: the checkpoint was "
                                         "saved with --global-batch-size 16, this run has 8"):
        check_phase_resume({"global_batch_size": 16}, args)
    assert consumed_validation_samples(args, 35) == 3 * 2 * 8
    assert consumed_validation_samples(argparse.Namespace(**{**vars(args), "skip_train": True}),
                                       35) == 0
    assert phase_start(argparse.Namespace(**{**vars(args), "phase_transition_iterations": None}),
                       50) == (0, 800)
