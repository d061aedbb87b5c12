"""A persistent cache of advisor answers (sqlite3, stdlib), shared by builds and processes.

Keyed by (advisor identity, request key): the identity names the endpoint, model and prompt
version (never a secret), the request key hashes the whole question. A cache is an
optimisation: any problem with the file (corrupt, locked too long, unwritable directory) is a
warning and a miss, never a failed build. After the first problem the cache turns itself off
for the rest of the process, so a broken file warns once rather than once per region.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from pathlib import Path

from coopt.llm_advisor.protocol import Advice, AdviceRequest

log = logging.getLogger("coopt.llm_advisor")

# Concurrent builds serialise on sqlite's file lock; wait this long before giving up.
LOCK_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS advice (
    advisor TEXT NOT NULL,
    request_key TEXT NOT NULL,
    advice TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (advisor, request_key)
)
"""


def default_cache_path() -> Path:
    """`$COOPT_CACHE_DIR/advice.sqlite`, else `~/.cache/coopt/advice.sqlite`."""
    root = os.environ.get("COOPT_CACHE_DIR")
    return Path(root) / "advice.sqlite" if root else Path.home() / ".cache" / "coopt" / "advice.sqlite"


class AdviceCache:
    """Advice by (advisor identity, request); hits come back with `source == "cache"`.

        >>> import tempfile, pathlib
        >>> from coopt.ir.region import RegionSummary
        >>> cache = AdviceCache(pathlib.Path(tempfile.mkdtemp()) / "advice.sqlite")
        >>> request = AdviceRequest(RegionSummary("r0", "x", (), ()), "x", {}, ({},), {})
        >>> cache.put("openai:http://localhost/v1|m", request, Advice([{}], "openai"))
        >>> cache.get("openai:http://localhost/v1|m", request).source
        'cache'
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_cache_path()
        self.problems: list[str] = []  # one-line warnings, drained by the advisor into Advice
        self._disabled = False

    def get(self, identity: str, request: AdviceRequest) -> Advice | None:
        """The cached advice, or None on a miss or any problem with the file."""
        if self._disabled or not self.path.exists():
            return None
        row = self._run(
            lambda db: db.execute(
                "SELECT advice FROM advice WHERE advisor = ? AND request_key = ?", (identity, request.key())
            ).fetchone()
        )
        if not row:
            return None
        try:
            advice = Advice.from_json(json.loads(row[0]))
        except (ValueError, KeyError, TypeError) as exc:
            self._problem(f"unreadable entry ({exc})")
            return None
        advice.source = "cache"
        return advice

    def put(self, identity: str, request: AdviceRequest, advice: Advice) -> None:
        """Store `advice` (its warnings are about this build only and are not kept)."""
        if self._disabled:
            return
        stored = Advice(advice.ranked, advice.source, rejected=advice.rejected, rationale=advice.rationale)
        text = json.dumps(stored.to_json(), sort_keys=True, default=str)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._problem(f"cannot create {self.path.parent} ({exc.strerror or exc})")
            return
        self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO advice (advisor, request_key, advice, created) VALUES (?, ?, ?, ?)",
                (identity, request.key(), text, time.time()),
            )
        )

    def take_problems(self) -> list[str]:
        """Warnings since the last call (each reported once)."""
        problems, self.problems = self.problems, []
        return problems

    # -- internals ---------------------------------------------------------------------
    def _run(self, action):
        """Run `action(db)` in one short transaction; None (and a warning) on any sqlite error."""
        try:
            db = sqlite3.connect(self.path, timeout=LOCK_TIMEOUT_S)
        except sqlite3.Error as exc:
            self._problem(str(exc))
            return None
        try:
            with db:  # commits on success, rolls back on error
                db.execute(_SCHEMA)
                return action(db)
        except sqlite3.Error as exc:
            self._problem(str(exc))
            return None
        finally:
            db.close()

    def _problem(self, reason: str) -> None:
        message = f"advice cache {self.path} unusable ({reason}); continuing without it"
        log.warning(message)
        self.problems.append(message)
        self._disabled = True
