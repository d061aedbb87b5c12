"""AdviceCache: round trip, default location, corrupt files, concurrent processes."""

from __future__ import annotations

import logging
import multiprocessing
import sqlite3

from advisor_support import matmul_request

from coopt.llm_advisor import Advice, AdviceCache, default_cache_path

IDENTITY = "openai:http://127.0.0.1/v1|m|prompt-v1"


def test_round_trip_marks_hits_as_cache(tmp_path):
    cache = AdviceCache(tmp_path / "sub" / "advice.sqlite")
    request = matmul_request(1)
    assert cache.get(IDENTITY, request) is None  # no file yet: a miss, no warning
    advice = Advice(list(request.legal[:2]), "openai", rejected=[{"params": {"x": 1}, "reason": "r"}],
                    warnings=["this build only"], rationale="why")
    cache.put(IDENTITY, request, advice)
    hit = cache.get(IDENTITY, request)
    assert (hit.ranked, hit.source, hit.rejected, hit.rationale) == (advice.ranked, "cache", advice.rejected, "why")
    assert hit.warnings == []  # warnings belong to the build that produced them
    assert cache.get("openai:other|m|prompt-v1", request) is None
    assert cache.take_problems() == []


def test_default_path_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("COOPT_CACHE_DIR", str(tmp_path))
    assert default_cache_path() == tmp_path / "advice.sqlite"
    assert AdviceCache().path == tmp_path / "advice.sqlite"
    monkeypatch.delenv("COOPT_CACHE_DIR")
    assert default_cache_path().parts[-3:] == (".cache", "coopt", "advice.sqlite")


def test_corrupt_file_is_a_warned_miss(tmp_path, caplog):
    path = tmp_path / "advice.sqlite"
    path.write_bytes(b"this is not a sqlite database" * 100)
    cache = AdviceCache(path)
    request = matmul_request(1)
    with caplog.at_level(logging.WARNING, logger="coopt.llm_advisor"):
        assert cache.get(IDENTITY, request) is None
        cache.put(IDENTITY, request, Advice(list(request.legal[:1]), "openai"))  # no crash
        assert cache.get(IDENTITY, request) is None
    problems = cache.take_problems()
    assert len(problems) == 1 and "unusable" in problems[0]  # warns once, then stays off
    assert "unusable" in caplog.text
    assert path.read_bytes().startswith(b"this is not")  # the user's file is left alone


def test_corrupt_entry_is_a_warned_miss(tmp_path):
    path = tmp_path / "advice.sqlite"
    cache = AdviceCache(path)
    request = matmul_request(1)
    cache.put(IDENTITY, request, Advice(list(request.legal[:1]), "openai"))
    with sqlite3.connect(path) as db:
        db.execute("UPDATE advice SET advice = 'not json'")
    assert AdviceCache(path).get(IDENTITY, request) is None


def _writer(path: str, worker: int) -> None:
    cache = AdviceCache(path)
    for m in range(1, 11):
        request = matmul_request(m, name=f"w{worker}")
        cache.put(IDENTITY, request, Advice([request.legal[worker]], "openai"))
        assert cache.get(IDENTITY, request) is not None
    assert cache.take_problems() == []


def test_concurrent_processes_share_one_file(tmp_path):
    path = str(tmp_path / "advice.sqlite")
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(path, i)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM advice").fetchone()[0] == 40
