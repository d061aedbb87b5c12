"""bench/decode.py: what a row keeps of a build's build.json."""

from __future__ import annotations

import json

import decode


def test_a_row_keeps_the_builds_seconds_and_its_checks_reference(tmp_path):
    (tmp_path / "build.json").write_text(json.dumps({
        "seconds": 163.3, "step_seconds": {"emit": 42.39, "end-to-end": 26.52},
        "end_to_end": {"ok": True, "reference_precision": "float64, streamed module by module", "max_abs_err": 0.18},
        "counters": {"fuse.kv_write": 32}, "unfused_ops": {"aten.embedding.default": 1}}))
    assert decode.build_summary(tmp_path) == {
        "seconds": 163.3, "step_seconds": {"emit": 42.39, "end-to-end": 26.52},
        "reference_precision": "float64, streamed module by module", "check_max_abs_err": 0.18,
        "unfused_ops": {"aten.embedding.default": 1}}


def test_a_build_without_an_end_to_end_record_says_so(tmp_path):
    (tmp_path / "build.json").write_text(json.dumps({"seconds": 2.0, "end_to_end": None}))
    summary = decode.build_summary(tmp_path)
    assert summary["seconds"] == 2.0 and summary["reference_precision"] is None and summary["step_seconds"] is None
