"""bench/long_prefill.py at tiny size on the CPU (the GPU run is the 131072-token prompt): the
chunk plan, the builds' example length, and a whole run whose four variants agree with eager.

The runs build the reference program (`--reference-program`: no kernel regions, seconds per
build); the kernels of a chunked prefill build are tested in tests/llama/test_llama_chunked_prefill.py.
"""

from __future__ import annotations

import json
import math

import pytest

import long_prefill
from long_prefill import chunk_plan


def test_the_chunk_plan_covers_the_prompt_in_ceil_calls_of_at_least_two_tokens():
    for length in range(2, 70):
        for chunk in (3, 16, 17, 64):
            plan = chunk_plan(length, chunk)
            assert plan[0][0] == 0 and plan[-1][1] == length
            assert all(end == start for (_, end), (start, _) in zip(plan, plan[1:]))  # contiguous
            assert all(2 <= end - start <= chunk for start, end in plan)
            assert len(plan) == math.ceil(length / chunk)
    assert chunk_plan(33, 16) == [(0, 16), (16, 31), (31, 33)]  # a 1-token tail borrows one
    assert chunk_plan(64, None) == chunk_plan(64, 64) == [(0, 64)]
    with pytest.raises(ValueError, match="too short"):
        chunk_plan(10, 2)


def test_the_builds_example_keeps_the_float64_check_small():
    full = long_prefill.parse_args([])
    assert (full.prompt, full.cache, full.chunks, full.layers) == (131072, 131072, [4096], 8)
    assert long_prefill.default_example(full, heads=32) == 256  # 8 B x 32 heads x 256 x 131072 = 8 GiB
    assert long_prefill.default_example(long_prefill.parse_args(["--quick"]), heads=32) == 1024
    assert long_prefill.default_example(long_prefill.parse_args(["--example", "512"]), heads=32) == 512
    tiny = long_prefill.parse_args(["--preset", "tiny", "--prompt", "64", "--chunk", "16"])
    assert tiny.layers is None and long_prefill.default_example(tiny, heads=4) == 16
    with pytest.raises(SystemExit):
        long_prefill.parse_args(["--variants", "eager,compile"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run of all four variants: a 33-token prompt (chunks 16 + 15 + 2) over a 48-position cache."""
    out = tmp_path_factory.mktemp("long") / "long.json"
    with pytest.MonkeyPatch.context() as env:
        for name in ("PRESET", "LAYERS", "BATCH", "POS", "MAX_SEQ", "PREFILL", "RAGGED"):
            env.delenv(f"COOPT_LLAMA_{name}", raising=False)
        env.delenv("COOPT_EXAMPLE_DTYPE", raising=False)
        result = long_prefill.main(["--preset", "tiny", "--prompt", "33", "--cache", "48", "--chunk", "16",
                                    "--dtype", "float32", "--reference-program", "--repeat", "1", "--out", str(out)])
    return result, out


def test_every_variant_runs_and_agrees_with_eager(tiny_run):
    result, _ = tiny_run
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["eager", "eager chunk 16", "coopt", "coopt chunk 16"]
    assert result["reference"] == "eager"
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["max_abs_err"] <= 1e-4 and row["top1_agrees"], row
        assert row["tokens_per_s"] == pytest.approx(33 / row["median_s"])
    assert rows["eager"]["calls"] == rows["coopt"]["calls"] == 1
    assert rows["eager chunk 16"]["calls"] == rows["coopt chunk 16"]["calls"] == math.ceil(33 / 16)


def test_the_chunked_build_takes_at_most_the_chunk(tiny_run):
    result, _ = tiny_run
    rows = {row["variant"]: row for row in result["rows"]}
    assert rows["coopt"]["build_length"] == [2, 48] and rows["coopt"]["build_prefill_chunk"] is None
    assert rows["coopt chunk 16"]["build_length"] == [2, 16] and rows["coopt chunk 16"]["build_prefill_chunk"] == 16
    assert rows["coopt chunk 16"]["logits_bytes_per_call"] == 16 * 256 * 4  # [1, 16, vocab] fp32
    assert rows["coopt"]["logits_bytes_per_call"] == 33 * 256 * 4


def test_without_cuda_memory_is_na_and_the_json_holds_the_run(tiny_run, capsys):
    result, out = tiny_run
    assert all(row["peak_bytes"] is None and row["baseline_bytes"] is None for row in result["rows"])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert {"gpu", "torch", "triton", "date", "commit"} <= set(saved["environment"])
    assert saved["settings"]["example"] == 16 and saved["settings"]["layers"] == 2
    table = long_prefill.table(result)
    assert table.count("| n/a | n/a |") == 4 and "| coopt chunk 16 | 3 |" in table


def test_a_variant_that_fails_is_a_row_and_the_others_still_run(tmp_path):
    """A chunk the chunked-prefill pass refuses (not a power of two): the coopt build fails, the
    eager chunked run at that chunk is the reference."""
    result = long_prefill.main(["--preset", "tiny", "--prompt", "40", "--chunk", "24", "--dtype", "float32",
                                "--variants", "eager-chunked,coopt-chunked", "--reference-program", "--repeat", "1"])
    eager, coopt = result["rows"]
    assert eager["status"] == "ok" and eager["calls"] == 2 and result["reference"] == "eager chunk 24"
    assert coopt["status"] == "build failed" and "power of two" in coopt["error"] and coopt["calls"] == 2
