"""The command blocks of README.md, docs/*.md and data/README.md run as documented.

A command block is a fenced block marked bash, sh, shell or console. The line above it says what
this test does with it, visibly in the Markdown source:

    <!-- doc-test: run -->              run here (CPU, well under a minute on 2 cores)
    <!-- doc-test: skip: <reason> -->   not run, for the reason given (root, a download, longer
                                        than a minute, placeholders for the reader's folders)

A block without either, or a command written as an indented block, fails the test: new
commands cannot be skipped silently. A fenced python block marked run is a script the reader
launches with torchrun: it runs as `.venv/bin/torchrun --standalone --nproc-per-node 2 BLOCK.py`
(python blocks without a marker are excerpts, not run).

Each doc with commands says once, at its top, how they run (CONVENTION: from the repository
root after `make install`, with `.venv/bin/python`; docs/gpu.md: a GPU machine's own Python),
and its commands call Python, pip and torchrun that way (a block for the reader's own
environment says so in its skip reason). Blocks run with bash -e from a copy of the repository
(the virtual environment and the prepared data linked in) as a fresh clone after `make install`
would: without the virtual environment on PATH, so a bare `python` is not the project's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import without_hidden

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = sorted([REPO / "README.md", REPO / "data/README.md", *(REPO / "docs").glob("*.md")])
COMMAND_LANGUAGES = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"^<!-- doc-test: (run|skip: .+) -->$")
# An indented line that starts like a command: it belongs in a marked fenced block.
INDENTED_COMMAND = re.compile(r"^ {4}(\$ )?(\.venv/bin/)?(python3?|torchrun|make|bash|sbatch|sudo|"
                              r"pretrain_scripts/|tools/)\b")
_COPY_SKIPPED = {".git", ".venv", "__pycache__", ".pytest_cache", "runs", "outputs", "build",
                 "dist"}
# How a doc says its commands run (once, at its top; compared with whitespace collapsed).
CONVENTION = ("after `make install`: Python is `.venv/bin/python` (the virtual environment "
              "`make install` made), so nothing needs activating.")
OWN_PYTHON = "run on a GPU machine, from the repository root, with that machine's own Python"
# Python, pip or torchrun called as a command (a line's start, after a pipe, `;`, `&&`, `(`,
# `$(`, `<(`, sudo or an environment assignment), not through .venv/bin/.
BARE_COMMAND = re.compile(r"(?:^|[|;&(]\s*|\$\(|<\(|\bsudo\s+|\b[A-Z_]+=\S*\s+)"
                          r"(python3?|pip3?|torchrun)\b")
READERS_ENVIRONMENT = "the reader's environment"


def command_blocks(path: Path):
    """(line number, marker or None, text) of each command block; raises on indented commands."""
    lines = path.read_text().splitlines()
    blocks, fence, body, start, marker = [], None, [], 0, None
    for number, line in enumerate(lines, start=1):
        if fence is None:
            match = re.match(r"^```(\w*)\s*$", line)
            if match:
                fence, body, start = match.group(1), [], number
                previous = next((l for l in reversed(lines[:number - 1]) if l.strip()), "")
                marker = MARKER.match(previous.strip())
            elif INDENTED_COMMAND.match(line):
                blocks.append((number, "indented", line.strip()))
        elif line.startswith("```"):
            if fence in COMMAND_LANGUAGES:
                blocks.append((start, marker.group(1) if marker else None, "\n".join(body)))
            elif fence == "python" and marker and marker.group(1) == "run":
                blocks.append((start, "run", _as_torchrun_script("\n".join(body))))
            fence = None
        else:
            body.append(line)
    return blocks


def _as_torchrun_script(source: str) -> str:
    """A python block as the bash command that writes it to a file and launches it."""
    assert "PARM_DOC_SCRIPT" not in source
    return (f"cat > doc_block.py <<'PARM_DOC_SCRIPT'\n{source}\nPARM_DOC_SCRIPT\n"
            f".venv/bin/torchrun --standalone --nproc-per-node 2 doc_block.py")


def _all_blocks():
    return [(path, number, marker, text) for path in DOC_FILES
            for number, marker, text in command_blocks(path)]


def _block_id(block) -> str:
    path, number, _, _ = block
    return f"{path.relative_to(REPO)}:{number}"


RUN_BLOCKS = [block for block in _all_blocks() if block[2] == "run"]


def test_every_command_block_is_run_or_says_why_not():
    problems = []
    for path, number, marker, text in _all_blocks():
        where = f"{path.relative_to(REPO)}:{number}"
        if marker == "indented":
            problems.append(f"{where}: command in an indented block; put it in a ```bash block "
                            f"with a doc-test marker: {text}")
        elif marker is None:
            problems.append(f"{where}: command block without <!-- doc-test: run --> or "
                            f"<!-- doc-test: skip: <reason> --> on the line above")
    assert not problems, "\n".join(problems)
    assert len(RUN_BLOCKS) >= 6, RUN_BLOCKS  # the one-process launch, plan_schedule, data, ...


def _top(path: Path) -> str:
    """The doc before its first section, whitespace collapsed."""
    return " ".join(path.read_text().split("\n## ", 1)[0].split())


def test_every_doc_says_once_how_its_commands_run_and_they_do():
    problems = []
    for path in DOC_FILES:
        blocks = [block for block in command_blocks(path) if block[1] != "indented"]
        where = path.relative_to(REPO)
        if not blocks:
            continue
        top, text = _top(path), " ".join(path.read_text().split())
        if OWN_PYTHON in top:
            continue  # docs/gpu.md: another machine's Python
        if CONVENTION not in top or text.count(CONVENTION) != 1:
            problems.append(f"{where}: say once, before its first section: ...{CONVENTION}")
        for number, marker, body in blocks:
            if marker and READERS_ENVIRONMENT in marker:
                continue
            for line in body.splitlines():
                match = BARE_COMMAND.search(line.split(" #")[0])
                if match:
                    problems.append(f"{where}:{number}: `{match.group(1)}` is not the project's: "
                                    f"write .venv/bin/{match.group(1)} ({line.strip()})")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory, prepared_data):
    """The working tree without build outputs, .venv and data/cache linked to the real ones."""
    copy = tmp_path_factory.mktemp("docs") / "repo"

    def skipped(directory, names):
        return [name for name in names if name in _COPY_SKIPPED or name.endswith(".egg-info")
                or (Path(directory) == REPO / "data" and name == "cache")]

    shutil.copytree(REPO, copy, ignore=skipped, symlinks=True)
    if (REPO / ".venv").exists():
        (copy / ".venv").symlink_to(REPO / ".venv")
    else:  # tests run by another environment's Python: it stands in for `make install`'s
        (copy / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (copy / "data/cache").symlink_to(REPO / "data/cache")
    return copy


def _fresh_shell_path() -> str:
    """PATH without the directory of this Python's environment (nor .venv/bin): as in a fresh
    shell, where the project's Python is only .venv/bin/python."""
    ours = {Path(sys.executable).parent.resolve(), (REPO / ".venv/bin").resolve()}
    return os.pathsep.join(entry for entry in os.environ["PATH"].split(os.pathsep)
                           if entry and Path(entry).resolve() not in ours)


# What a training run prints (Megatron-LM's lines and this project's `> ` ones), and the lines of
# the README's library block: anything else in their output is noise the test counts.
TRAINING_LINE = re.compile(r"^(> |note: |warning: | iteration +\d+/|  expert load, layer|-+$| "
                           r"validation loss at )")
LIBRARY_LINE = re.compile(r"^rank \d+: loss ")
LIBRARY_NOTE = ("UserWarning: optional packages not installed: ",
                "megatron_parm.hide_library_warnings()")


def _is_training_run(text: str) -> bool:
    """A block whose every command runs a pretraining script (alone or under the launcher)."""
    commands = [line for line, previous in zip(text.splitlines(), [""] + text.splitlines())
                if not previous.rstrip().endswith("\\")]
    return bool(commands) and all(re.search(r"pretrain_scripts/pretrain_\w+\.py", line)
                                  for line in commands)


def _noise(path: Path, text: str, output: str) -> list:
    """The lines of a training run or of the library block that are neither their results nor
    the one line that says what remains (the optional packages), warnings included."""
    lines = [line for line in output.splitlines() if line.strip()]
    if text.startswith("cat > doc_block.py"):
        results = [line for line in lines if LIBRARY_LINE.match(line)]
        others = [line for line in lines if not LIBRARY_LINE.match(line)]
        assert len(results) == 2, output  # one line per rank
        notes = [line for line in others if any(part in line for part in LIBRARY_NOTE)]
        return [line for line in others if line not in notes] + notes[len(LIBRARY_NOTE):]
    if _is_training_run(text):
        return [line for line in lines
                if not TRAINING_LINE.match(line) or line.startswith("warning: ")]
    return []


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=_block_id)
def test_documented_command_runs(block, repo_copy):
    path, number, _, text = block
    # a reader's shell: the test extra's transformers importable (tools/tiny_hf_model.py)
    env = without_hidden(dict(os.environ, PATH=_fresh_shell_path(), OMP_NUM_THREADS="1"))
    for name in ("PYTHONWARNINGS", "VIRTUAL_ENV"):
        env.pop(name, None)
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=repo_copy, env=env,
                          capture_output=True, text=True, timeout=600)
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{path.relative_to(REPO)}:{number} failed:\n{text}\n{output}"
    assert "Traceback" not in proc.stdout + proc.stderr, output
    noise = _noise(path, text, proc.stdout + "\n" + proc.stderr)
    assert not noise, f"{len(noise)} lines a user cannot act on:\n" + "\n".join(noise)
