"""TuningDB: round trip, and every part of the key invalidates a cached measurement."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from coopt.tune.db import TuningDB, TuningKey, default_db_path
from coopt.tune.measurement import Measurement

from tune_helpers import ADD, add_region, write_module

TIMING = Measurement(median_ms=0.041, p20_ms=0.040, p80_ms=0.043, device="NVIDIA H200", bytes_moved=3072, flops=256)


def key_for(path: Path, dims=None, device="NVIDIA H200", versions="torch=2.11 triton=3.6", region=None) -> TuningKey:
    return TuningKey.for_candidate(path, region or add_region(), dims or {"B": 4}, device, versions)


def test_round_trip(tmp_path):
    module = write_module(tmp_path, "c0", ADD)
    db = TuningDB(tmp_path / "db" / "tuning.sqlite")
    assert db.get(key_for(module)) is None
    db.put(key_for(module), TIMING)
    assert db.get(key_for(module)) == TIMING
    assert len(db) == 1
    # a second handle on the same file sees it: the cache outlives the process
    assert TuningDB(tmp_path / "db" / "tuning.sqlite").get(key_for(module)) == TIMING


def test_put_replaces(tmp_path):
    module = write_module(tmp_path, "c0", ADD)
    db = TuningDB(tmp_path / "tuning.sqlite")
    db.put(key_for(module), TIMING)
    db.put(key_for(module), replace(TIMING, median_ms=0.5))
    assert db.get(key_for(module)).median_ms == 0.5
    assert len(db) == 1


def test_failed_measurements_are_not_cached(tmp_path):
    module = write_module(tmp_path, "c0", ADD)
    db = TuningDB(tmp_path / "tuning.sqlite")
    db.put(key_for(module), Measurement.failed("timed out after 60 s"))
    assert db.get(key_for(module)) is None


def test_key_sensitivity(tmp_path):
    module = write_module(tmp_path, "c0", ADD)
    db = TuningDB(tmp_path / "tuning.sqlite")
    db.put(key_for(module), TIMING)

    assert db.get(key_for(module, dims={"B": 8})) is None
    assert db.get(key_for(module, device="NVIDIA H100 80GB HBM3")) is None
    assert db.get(key_for(module, versions="torch=2.11 triton=3.7")) is None
    # same source and dims, different static shape: must not share a timing
    wider = replace(add_region(), inputs=tuple(replace(s, shape=("B", 128)) for s in add_region().inputs))
    assert db.get(key_for(module, region=wider)) is None

    original = module.read_text()
    module.write_text(original + "# edited\n")
    assert db.get(key_for(module)) is None
    module.write_text(original)
    assert db.get(key_for(module)) == TIMING  # back to the original source: a hit again


def test_default_path_honours_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("COOPT_CACHE_DIR", str(tmp_path / "cache"))
    assert default_db_path() == tmp_path / "cache" / "tuning.sqlite"
    assert TuningDB().path == tmp_path / "cache" / "tuning.sqlite"
    monkeypatch.delenv("COOPT_CACHE_DIR")
    assert default_db_path() == Path.home() / ".cache" / "coopt" / "tuning.sqlite"


def test_current_versions_used_by_default(tmp_path):
    import torch
    import triton

    key = TuningKey.for_candidate(write_module(tmp_path, "c0", ADD), add_region(), {"B": 4}, "cpu")
    assert key.versions == f"torch={torch.__version__} triton={triton.__version__}"
