"""Named rewrite counters. Every rewrite counts itself; the report and the tests read them, so a
pattern that silently stops matching fails a test instead of slowing a model down unnoticed."""

from __future__ import annotations

import contextlib
from collections import Counter
from contextvars import ContextVar

_current: ContextVar[Counter | None] = ContextVar("coopt_counters", default=None)


def count(name: str, n: int = 1) -> None:
    counters = _current.get()
    if counters is not None:
        counters[name] += n


@contextlib.contextmanager
def collect_counters():
    """`with collect_counters() as c:` — every count() inside lands in c (a Counter)."""
    counters: Counter = Counter()
    token = _current.set(counters)
    try:
        yield counters
    finally:
        _current.reset(token)
