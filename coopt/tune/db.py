"""A sqlite cache of measurements, so rebuilding an unchanged model does not re-time it.

A measurement is reused only when everything that could change it is the same: the candidate's
source (sha256), the concrete shapes it ran at, the GPU, and the torch and triton versions.
Only successful measurements are stored: a timeout or crash may be transient, so it is retried.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from coopt.ir.region import RegionSummary
from coopt.tune.measurement import Measurement

_SCHEMA = """
CREATE TABLE IF NOT EXISTS measurements (
    source_sha256 TEXT NOT NULL,
    shapes TEXT NOT NULL,
    device TEXT NOT NULL,
    versions TEXT NOT NULL,
    measurement TEXT NOT NULL,
    PRIMARY KEY (source_sha256, shapes, device, versions)
)
"""


def default_db_path() -> Path:
    """`$COOPT_CACHE_DIR/tuning.sqlite`, else `~/.cache/coopt/tuning.sqlite`."""
    cache_dir = os.environ.get("COOPT_CACHE_DIR")
    base = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "coopt"
    return base / "tuning.sqlite"


def current_versions() -> str:
    """The software that decides how a kernel compiles: "torch=X triton=Y"."""
    import torch
    import triton

    return f"torch={torch.__version__} triton={triton.__version__}"


@dataclass(frozen=True)
class TuningKey:
    """What a cached measurement is valid for."""

    source_sha256: str
    shapes: str  # canonical JSON: dims plus concrete input/output shapes and dtypes
    device: str  # GPU name, or "cpu" for the test-only CPU path
    versions: str

    @staticmethod
    def for_candidate(
        module_path: str | Path, region: RegionSummary, dims: dict[str, int], device: str,
        versions: str | None = None,
    ) -> "TuningKey":
        """Key for timing `module_path` on `region` at `dims` on `device`.

        Shapes, not just dims, go into the key: two regions can share a kernel source while their
        static shapes (a weight's [N, K]) differ.
        """
        source = Path(module_path).read_bytes()
        shapes = json.dumps(
            {
                "dims": dims,
                "inputs": [[list(s.concrete(dims)), s.dtype] for s in region.inputs],
                "outputs": [[list(s.concrete(dims)), s.dtype] for s in region.outputs],
            },
            sort_keys=True,
        )
        return TuningKey(hashlib.sha256(source).hexdigest(), shapes, device, versions or current_versions())


class TuningDB:
    """Measurements keyed by `TuningKey`, in one sqlite file.

    >>> db = TuningDB(tmp_path / "tuning.sqlite")              # doctest: +SKIP
    >>> db.put(key, measurement); db.get(key) == measurement    # doctest: +SKIP
    True
    """

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            conn.execute(_SCHEMA)

    def _connect(self):
        # One short connection per call: builds and `coopt tune` may share the file, and sqlite's
        # busy timeout handles the overlap. sqlite3's own context manager only commits and never
        # closes, hence _Transaction.
        return _Transaction(sqlite3.connect(self.path, timeout=30))

    def get(self, key: TuningKey) -> Measurement | None:
        """The stored measurement for `key`, or None."""
        with self._connect() as conn:
            row = conn.execute(
                "SELECT measurement FROM measurements WHERE source_sha256=? AND shapes=? AND device=? AND versions=?",
                (key.source_sha256, key.shapes, key.device, key.versions),
            ).fetchone()
        return Measurement.from_json(json.loads(row[0])) if row else None

    def put(self, key: TuningKey, measurement: Measurement) -> None:
        """Store (or replace) a successful measurement; failed ones are ignored (see module doc)."""
        if not measurement.ok:
            return
        with self._connect() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO measurements VALUES (?, ?, ?, ?, ?)",
                (key.source_sha256, key.shapes, key.device, key.versions, json.dumps(measurement.to_json())),
            )

    def __len__(self) -> int:
        with self._connect() as conn:
            return conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]


class _Transaction:
    """Commit on success, roll back on error, and always close."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn

    def __enter__(self) -> sqlite3.Connection:
        return self._conn

    def __exit__(self, exc_type, exc, tb) -> None:
        with closing(self._conn):
            if exc_type is None:
                self._conn.commit()
            else:
                self._conn.rollback()
