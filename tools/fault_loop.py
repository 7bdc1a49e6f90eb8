"""Kill a rank at each fault point several times and report how long the job takes to end.

    python tools/fault_loop.py --repeats 5 [--faults forward all_to_all ...] [--out DIR]

Each try is one `python -m megatron_parm.launch` of 4 gloo ranks on GPT-2 MoE tiny (the
faults and the training flags of tests/e2e/test_faults.py, without restarts): one rank dies at
the fault point, and the try records the seconds from the kill to the launcher's exit, its exit
status, whether its one line came, and any process of the job still alive after it (none may
be). `stop` is a rank that hangs (SIGSTOP) instead of dying: the others wait for it until
--distributed-timeout-minutes (0.5 here). Prints one row per fault (min / median / max) and
writes every try to OUT/fault_loop.json. Not part of the test suite: 5 tries of the 7 faults
take about 20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests/e2e")]

from megatron_parm import cli  # noqa: E402

HUNG_TIMEOUT_MINUTES = "0.5"


def one_try(fault: str, run: Path) -> dict:
    import test_faults

    run.mkdir(parents=True)
    flags = ["--distributed-timeout-minutes", HUNG_TIMEOUT_MINUTES] if fault == "stop" else []
    result = test_faults.launch(run, "job", mode=fault, train_flags=flags, timeout=1200)
    kill_file = run / "kill-0.json"
    killed = json.loads(kill_file.read_text())["time"] if kill_file.exists() else None
    lines = [line for line in result["output"].splitlines() if line.startswith("launch: rank")]
    return {"fault": fault, "status": result["status"],
            "seconds": None if killed is None else round(result["ended"] - killed, 2),
            "line": lines[-1] if lines else None, "survivors": result["survivors"],
            "traceback": "Traceback" in result["output"]}


def main(argv=None) -> int:
    import test_faults

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--faults", nargs="+", default=list(test_faults.ONE_FAULT),
                        choices=list(test_faults.ONE_FAULT))
    parser.add_argument("--out", default=None, help="Default: a new temporary folder.")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    out = Path(args.out or tempfile.mkdtemp(prefix="fault_loop-"))
    tries = []
    for repeat in range(args.repeats):
        for fault in args.faults:
            result = one_try(fault, out / f"{fault}-{repeat}")
            tries.append(result)
            print(f"{fault:>10} try {repeat + 1}: {result['seconds']} s, status "
                  f"{result['status']}, survivors {len(result['survivors'])}", flush=True)
            (out / "fault_loop.json").write_text(json.dumps(tries, indent=1))
    print(f"\n{'fault':>10} | tries | seconds to the end: min / median / max | statuses | "
          f"one line | survivors | tracebacks")
    for fault in args.faults:
        rows = [t for t in tries if t["fault"] == fault]
        seconds = [t["seconds"] for t in rows if t["seconds"] is not None]
        print(f"{fault:>10} | {len(rows):>5} | {min(seconds):6.2f} / "
              f"{statistics.median(seconds):6.2f} / {max(seconds):6.2f} | "
              f"{sorted({t['status'] for t in rows})} | "
              f"{sum(t['line'] is not None for t in rows)}/{len(rows)} | "
              f"{sum(len(t['survivors']) for t in rows)} | {sum(t['traceback'] for t in rows)}")
    print(f"\nevery try: {out / 'fault_loop.json'}")
    return 0


if __name__ == "__main__":
    cli.run(main)
