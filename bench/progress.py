"""Build progress for benchmark logs: elapsed seconds and the build step, one line each, so a
slow build in a GPU log shows where it spent its time."""

from __future__ import annotations

import time


def build_progress(indent: str = "    "):
    start = time.monotonic()

    def progress(step: str, detail: str = "") -> None:
        print(f"{indent}{time.monotonic() - start:7.1f}s [{step}] {detail}", flush=True)

    return progress
