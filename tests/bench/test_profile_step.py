"""bench/profile_step.py without a GPU: the per-launch table from profiled kernel events."""

from __future__ import annotations

from types import SimpleNamespace

from profile_step import launch_table


def event(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_each_launch_keeps_its_own_duration_and_the_gap_before_it():
    # two replays of a 3-launch step: two GEMVs of one name told apart by their place in the step
    kernels = [event("gemv", 0, 10), event("attention", 12, 20), event("gemv", 21, 25),
               event("gemv", 30, 42), event("attention", 44, 50), event("gemv", 53, 57)]
    table = launch_table(kernels, steps=2)
    assert [t["name"] for t in table] == ["gemv", "attention", "gemv"]
    assert [t["us"] for t in table] == [11.0, 7.0, 4.0]
    # the first launch's gap: after the previous replay's last kernel (none before the first)
    assert [t["gap_us"] for t in table] == [2.5, 2.0, 2.0]
