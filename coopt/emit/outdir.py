"""The output directory is written whole or not at all: build in a sibling temp dir, then rename.

A build's weights are most of what it writes (5.5 GB for 8 Llama-3-8B layers, 16 GB for 32), and
they are written last, after minutes of tuning: where the disk cannot hold them the build says so
before it starts (the model's parameters against the free space) and again, exactly, before the
weights are written (`ensure_free_space`), instead of failing inside torch.save (session 22: a
device machine's /tmp filled by earlier builds, `RuntimeError: ... unexpected pos`).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from coopt.errors import OutputDirError


# room left beside what a build's weights need: its IR dumps, report, verification records
_SPACE_MARGIN_BYTES = 64 << 20


def ensure_free_space(directory: Path, needed: int, what: str) -> None:
    """Refuse (OutputDirError, exit 6) when the file system holding `directory` has less than
    `needed` bytes (plus a margin) free for `what`."""
    free = shutil.disk_usage(directory).free
    if free < needed + _SPACE_MARGIN_BYTES:
        raise OutputDirError(f"not enough disk space for {what} in '{directory}': "
                             f"{_gb(needed)} needed, {_gb(free)} free")


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e7 else f"{size / 1e6:.1f} MB"


def check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputDirError(f"output path '{out_dir}' exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise OutputDirError(f"output directory '{out_dir}' is not empty; pass --force to replace it")


@contextlib.contextmanager
def staged_out_dir(out_dir: Path, force: bool):
    """Yield a temp dir next to `out_dir`; on success it replaces `out_dir`, on error it vanishes."""
    out_dir = Path(out_dir).resolve()
    check_out_dir(out_dir, force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        yield staging
        if out_dir.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(trash / "old")
            staging.rename(out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
