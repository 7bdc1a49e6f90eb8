"""A measuring tool's output: its record as JSON (measured now, or read back with the tool's
--from-json) and the Markdown report rendered from it, both in one folder."""

from __future__ import annotations

import datetime
import json
import os
from typing import Callable, Optional


def utc_stamp() -> str:
    """Now, as the records' "date" reads: 2026-12-04 07:52 UTC."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def record_and_report(output: str, stem: str, from_json: Optional[str],
                      measure: Callable[[], dict], render: Callable[[dict], str]) -> dict:
    """The record: read from FROM_JSON, or MEASURE()d and written to OUTPUT/STEM.json; its
    report, RENDER(record), written to OUTPUT/STEM.md and printed."""
    os.makedirs(output, exist_ok=True)
    if from_json:
        with open(from_json) as handle:
            saved = json.load(handle)
    else:
        saved = measure()
        with open(os.path.join(output, f"{stem}.json"), "w") as handle:
            json.dump(saved, handle, indent=1)
    text = render(saved)
    with open(os.path.join(output, f"{stem}.md"), "w") as handle:
        handle.write(text)
    print(text, end="")
    return saved
