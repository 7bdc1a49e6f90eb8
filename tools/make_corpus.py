"""Build a small English pretraining corpus from text that ships with CPython.

The corpus is JSON lines, one document per line: {"text": ..., "source": ...}.
Two sources, both under the PSF license (see data/README.md):

  * pydoc_data.topics: the Python Language Reference sections that `help()` shows,
    one document per topic;
  * docstrings of the standard library's pure-Python modules, one document per docstring
    of a module, class or function, skipping tests, demos and short docstrings.

Small documents keep every train/valid/test share of Megatron's usual --split 969,30,1
non-empty, and a docstring is a coherent text of a few sentences, as BERT's
next-sentence pairs want.

Nothing is downloaded. The output depends only on the Python that runs the script, so
the repository ships the result (data/corpus.jsonl) built with CPython 3.11.

    python tools/make_corpus.py --output data/corpus.jsonl
    python tools/make_corpus.py --output /tmp/big.jsonl --max-bytes 0   # no size cap
"""

import argparse
import ast
import inspect
import json
import os
import sys
import sysconfig

# Stdlib folders whose docstrings are tests, demos, vendored code or GUI plumbing.
_SKIPPED_DIRS = {
    "__pycache__", "test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo",
    "ensurepip", "tkinter", "pydoc_data",
}


def _pydoc_topic_documents():
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield {"text": text, "source": f"pydoc_data.topics:{name}"}


def _module_docstrings(path, min_chars):
    """Yield (name, docstring) for the module and its classes and functions, in source order."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    # ast.walk is breadth-first; sort by line so documents follow the source.
    nodes = [tree] + sorted(
        (node for node in ast.walk(tree)
         if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))),
        key=lambda node: node.lineno,
    )
    for node in nodes:
        docstring = ast.get_docstring(node, clean=False)
        if docstring:
            docstring = inspect.cleandoc(docstring).strip()
            if len(docstring) >= min_chars:
                yield getattr(node, "name", "<module>"), docstring


def _stdlib_docstring_documents(stdlib_root, min_chars):
    for dirpath, dirnames, filenames in os.walk(stdlib_root):
        dirnames[:] = sorted(
            name for name in dirnames
            if name not in _SKIPPED_DIRS and not name.startswith("config-")
        )
        for filename in sorted(filenames):
            if not filename.endswith(".py") or filename.startswith("test_"):
                continue
            path = os.path.join(dirpath, filename)
            try:
                docstrings = list(_module_docstrings(path, min_chars))
            except (SyntaxError, UnicodeDecodeError):
                continue  # a few stdlib files are deliberately broken or not UTF-8
            module = os.path.relpath(path, stdlib_root)[:-3].replace(os.sep, ".")
            for name, docstring in docstrings:
                yield {"text": docstring, "source": f"stdlib:{module}:{name}"}


def build_corpus(max_bytes, min_docstring_chars):
    """Return the list of documents, topics first, capped at max_bytes of text."""
    stdlib_root = sysconfig.get_paths()["stdlib"]
    documents = []
    num_bytes = 0
    for document in list(_pydoc_topic_documents()) + list(
            _stdlib_docstring_documents(stdlib_root, min_docstring_chars)):
        size = len(document["text"].encode("utf-8"))
        if max_bytes and num_bytes + size > max_bytes:
            continue  # keep scanning: a later, smaller document may still fit
        documents.append(document)
        num_bytes += size
    return documents


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="Output .jsonl path.")
    parser.add_argument("--max-bytes", type=int, default=1_600_000,
                        help="Cap on the UTF-8 text size; 0 for no cap.")
    parser.add_argument("--min-docstring-chars", type=int, default=120,
                        help="Skip docstrings shorter than this (signatures, one-liners).")
    args = parser.parse_args(argv)
    if args.max_bytes < 0:
        raise ValueError(f"--max-bytes must be >= 0, got {args.max_bytes}")

    documents = build_corpus(args.max_bytes, args.min_docstring_chars)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        for document in documents:
            handle.write(json.dumps(document, ensure_ascii=False) + "\n")
    num_chars = sum(len(document["text"]) for document in documents)
    print(f"wrote {len(documents)} documents, {num_chars} characters to {args.output} "
          f"(Python {sys.version.split()[0]})")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_parm import cli

    cli.run(main)
