"""Write docs/flags.md: every flag of Megatron-LM's training parser with what it does here
(implemented, no effect, refused) and why, generated from megatron_parm/settings/.

    python tools/flag_table.py            # rewrite docs/flags.md
    python tools/flag_table.py --check    # exit 1 if docs/flags.md is not current

tests/unit/test_flag_surface.py runs the check.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_parm import cli  # noqa: E402
from megatron_parm.settings import doc_table  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"compare with {doc_table.DOC} instead of writing it")
    args = parser.parse_args(argv)
    path = os.path.join(ROOT, doc_table.DOC)
    text = doc_table.markdown()
    if args.check:
        with open(path, encoding="utf-8") as handle:
            current = handle.read() == text
        print(f"{doc_table.DOC} is {'current' if current else 'out of date: run tools/flag_table.py'}")
        return 0 if current else 1
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    print(f"wrote {doc_table.DOC}")
    return 0


if __name__ == "__main__":
    cli.run(main)
