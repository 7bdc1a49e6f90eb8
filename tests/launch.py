"""Start a multi-rank gloo job for a test: one torchrun launch, output captured."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Packages hidden from the processes the tests start (tests/hidden/transformers says why).
HIDDEN = str(REPO / "tests" / "hidden")


def hide_test_only_packages() -> None:
    """Put HIDDEN first on the PYTHONPATH every process started from now on inherits."""
    paths = [HIDDEN, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                       if p and p != HIDDEN)]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)


def without_hidden(env: dict) -> dict:
    """ENV with HIDDEN off its PYTHONPATH: for a process that imports a test-only package."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != HIDDEN]
    env = dict(env)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env.pop("PYTHONPATH", None)
    return env


def load_tool(name: str):
    """tools/NAME.py as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quiet_env(env=None) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))


def pids_with_marker(marker: str):
    """Processes whose environment holds MARKER, e.g. PARM_TEST_LAUNCH=<uuid> (a test's launch
    and all its descendants)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker.encode() in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def process_environ(pid: int) -> dict:
    """A process's environment variables ({} if it is gone or not readable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry]
    except OSError:
        return {}
    return {key.decode(): value.decode(errors="replace") for key, value in pairs}


def convert_checkpoint(*args, timeout: int = 600) -> subprocess.CompletedProcess:
    """tools/convert_checkpoint.py ARGS from the repo root; the caller checks the result."""
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=_quiet_env())


def convert_all(jobs: dict, parallel: int = 2) -> dict:
    """{name: convert_checkpoint(*args)} for JOBS {name: args} with no job reading another's
    output, PARALLEL at a time (each is one process, mostly its imports: 2 fill 2 cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(parallel) as pool:
        futures = {name: pool.submit(convert_checkpoint, *args) for name, args in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def build_wheel(folder: Path) -> Path:
    """`pip wheel --no-deps` of a copy of the package's sources (pyproject.toml, README.md,
    megatron_parm/) in FOLDER, offline; returns the wheel (about 10 s on 2 cores)."""
    import shutil

    source = folder / "src"
    shutil.copytree(REPO / "megatron_parm", source / "megatron_parm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "-q", "wheel", "--no-deps",
                    "--no-build-isolation", "-w", str(folder / "w"), str(source)],
                   check=True, capture_output=True)
    return next((folder / "w").glob("*.whl"))


def torchrun(script: str, nproc: int, *args: str, timeout: int = 900, env=None) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc script args...` from the repo root; raise with its log on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *args]
    run_env = _quiet_env(env)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=run_env)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-5000:]}\n{failure_excerpt(proc.stderr)}")
    return proc


def run_worker_module(test_file: str, nproc: int, run_dir: Path, timeout: int = 900):
    """An e2e test module run as its own worker: `torchrun TEST_FILE worker OUT.json RUN_DIR`;
    returns (the JSON its rank 0 wrote to RUN_DIR/results.json, torchrun's stdout)."""
    out = run_dir / "results.json"
    proc = torchrun(str(Path(test_file).resolve().relative_to(REPO)), nproc, "worker", str(out),
                    str(run_dir), timeout=timeout)
    return json.loads(out.read_text()), proc.stdout


def failure_excerpt(stderr: str, tail: int = 4000) -> str:
    """The first Python traceback in a failed launch's stderr, then its tail.

    A bare tail is mostly torchrun's own report and per-rank warnings; the rank's traceback,
    the one line that says what went wrong, is easily cut off above it.
    """
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    first = ""
    if start is not None:
        end = start + 1
        while end < len(lines) and (lines[end].startswith((" ", "\t", "[rank")) or end == start + 1):
            end += 1
        first = "\n".join(lines[start:min(end + 1, start + 120)])
        first = f"--- first traceback (stderr line {start + 1}) ---\n{first}\n--- stderr tail ---\n"
    return first + stderr[-tail:]


class WorkerRecords(dict):
    """world size -> the records a multi-rank worker wrote, its launch run on first use:
    `torchrun --nproc-per-node WORLD SCRIPT *argv(world, OUT.json)`."""

    def __init__(self, tmp_path_factory, script: str, argv):
        super().__init__()
        self.tmp_path_factory, self.script, self.argv = tmp_path_factory, script, argv

    def __missing__(self, world):
        path = self.tmp_path_factory.mktemp(f"{Path(self.script).stem}-w{world}") / "records.json"
        torchrun(self.script, world, *self.argv(world, str(path)))
        self[world] = json.loads(path.read_text())
        return self[world]
