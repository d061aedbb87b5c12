"""The output directory is written whole or not at all: build in a sibling temp dir, then rename."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from coopt.errors import OutputDirError


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
