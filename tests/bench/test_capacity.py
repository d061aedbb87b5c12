"""bench/capacity.py on the CPU: the allocator arithmetic is the pool's, the fill keeps room for
the measured steps, and a tiny `--throughput` run (reference-program builds) serves sequences of
mixed lengths from paged bf16 / fp8 pools and a static batch within one KV budget."""

from __future__ import annotations

import json
import math

import pytest
import torch

import capacity

SMALL = ["--layers", "2", "--budget-gib", "0.01", "--min-length", "16", "--max-length", "256"]


def test_capacity_counts_follow_the_pool_arithmetic():
    args = capacity.parse_args(SMALL)
    rows = capacity.capacity_rows(args)
    lengths = capacity.draw_lengths(1_000_000, 16, 256, 0)
    budget = int(0.01 * 2**30)
    per_token = 2 * 2 * capacity.KV_HEADS * capacity.HEAD_DIM * 2  # layers x K,V x heads x D x bf16
    static = rows["static bf16 (max length each)"]
    assert static["sequences"] == budget // (256 * per_token) and static["tokens"] == sum(lengths[:static["sequences"]])
    bf16, fp8 = rows["paged bf16"], rows["paged fp8 (per-head scales)"]
    for row, element in ((bf16, 2), (fp8, 1)):
        assert row["bytes_per_page"] == per_token // 2 * element * 16 and row["pages"] == budget // row["bytes_per_page"]
        count = row["sequences"]
        assert row["tokens"] == sum(lengths[:count])
        assert row["pages_in_use"] == sum(math.ceil(n / 16) for n in lengths[:count]) <= row["pages"]
        assert math.ceil(lengths[count] / 16) > row["pages"] - row["pages_in_use"]  # the next one did not fit
    assert fp8["pages"] in (2 * bf16["pages"], 2 * bf16["pages"] + 1)  # half the bytes per page; each count rounds down
    assert fp8["sequences"] > bf16["sequences"] > static["sequences"]


def test_the_default_run_still_prints_the_session_3_table(capsys):
    capacity.main([])
    printed = capsys.readouterr().out
    assert "| static bf16 (max length each) | 16 | 78,566 | 15.0% | 1.0x |" in printed
    assert "| paged bf16 | 78 | 514,217 | 99.9% | 4.9x |" in printed
    assert "| paged fp8 (per-head scales) | 151 | 1,033,488 | 99.9% | 9.4x |" in printed


def test_cuda_graphs_are_the_default_on_the_gpu_only(capsys):
    assert capacity.parse_args([]).cuda_graph is torch.cuda.is_available()
    assert capacity.parse_args(["--no-cuda-graph"]).cuda_graph is False
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            capacity.parse_args(["--throughput", "--cuda-graph"])
        assert "CUDA graphs need a CUDA device" in capsys.readouterr().err


class FakeStep(torch.nn.Module):
    """A paged ragged step without a compiler: logits of token 1, one pool to hold pages."""

    def __init__(self, num_pages: int, batch: int = 2):
        super().__init__()
        self.paged = {"tokens": 0, "positions": 1, "page_table": 2, "dtype": "int64", "per_row": True, "batch": batch,
                      "length": [1, 1], "token_range": [0, 4], "page_size": 16, "num_pages": num_pages,
                      "max_pages": 8, "max_seq": 128, "pools": ["pool"]}
        self.register_buffer("pool", torch.zeros(num_pages, 1, 16, 1))
        self.calls = 0

    def state_tensor(self, name):
        return self.pool

    def forward(self, tokens, positions, table):
        self.calls += 1
        return torch.nn.functional.one_hot(torch.ones_like(tokens), 4).float()


def test_the_fill_releases_the_newest_until_the_steps_fit():
    decoder = capacity.placed_decoder(FakeStep(num_pages=9))  # 8 usable pages, one scratch
    row = capacity.fill(decoder, [60, 30, 20, 5], steps=5)  # 4 + 2 + 2 pages: the pool is full at 5
    assert (row["capacity_sequences"], row["capacity_tokens"], row["capacity_pages"]) == (3, 110, 8)
    # 60 -> 65 and 30 -> 35 each need a page; 20 -> 25 none: the newest (20) goes, freeing 2
    assert (row["sequences"], row["tokens"]) == (2, 90) and decoder.pages.free_pages() == 2
    first = decoder.step()  # the placed sequences' pending tokens, no model call
    assert first == dict.fromkeys(decoder.live_sequences(), 0) and decoder.model.calls == 0
    for _ in range(5):
        assert decoder.step() == dict.fromkeys(decoder.live_sequences(), 1)
    assert [decoder.length(s) for s in decoder.live_sequences()] == [65, 35] and decoder.model.calls == 5
    assert decoder.pages.free_pages() == 0  # the released pages were exactly what the steps took
    row = capacity.fill(capacity.placed_decoder(FakeStep(num_pages=9)), [60, 30, 20], steps=0)
    assert row["sequences"] == row["capacity_sequences"] == 3  # no steps, nothing released


def test_the_planned_step_takes_every_sequence_the_decoder_will_hold():
    # planned before any build: the rows of a step that decodes all of a pool's sequences at once
    lengths = capacity.draw_lengths(500, 8, 100, seed=1)
    for pages in (9, 40, 130):
        held = capacity.fill(capacity.placed_decoder(FakeStep(num_pages=pages)), lengths, steps=4)["sequences"]
        batch = capacity.planned_step_batch(pages, 16, lengths, steps=4, max_rows=1000)
        assert batch % 8 == 0 and held <= batch < held + 8 or batch == 8 >= held, (pages, held, batch)
        # at most max_rows a call: the fewest calls, the rows shared evenly between them
        capped = capacity.planned_step_batch(pages, 16, lengths, steps=4, max_rows=16)
        calls = -(-held // capped)
        assert capped % 8 == 0 and capped <= 16 and calls == max(1, -(-held // 16)), (pages, held, capped)
        assert capped * calls - held < 8 * calls, (pages, held, capped)
    args = capacity.parse_args(["--throughput", "--step-batch", "capacity"])
    assert args.step_batch == "capacity" and capacity.parse_args(["--step-batch", "12"]).step_batch == 12
    with pytest.raises(SystemExit):
        capacity.parse_args(["--step-batch", "1"])


def run_tiny(out, *extra) -> dict:
    """bench/capacity.py --throughput on the tiny preset, reference programs (seconds on a CPU)."""
    with pytest.MonkeyPatch.context() as env:
        for name in ("PRESET", "LAYERS", "BATCH", "POS", "MAX_SEQ", "PREFILL", "RAGGED"):
            env.delenv(f"COOPT_LLAMA_{name}", raising=False)
        env.delenv("COOPT_EXAMPLE_DTYPE", raising=False)
        return capacity.main([*SMALL, "--throughput", "--preset", "tiny", "--decode-budget-mib", "0.125",
                              "--decode-lengths", "8:64", "--steps", "2", "--dtype", "float32",
                              "--reference-program", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def tiny_throughput(tmp_path_factory):
    out = tmp_path_factory.mktemp("capacity") / "capacity.json"
    return run_tiny(out, "--step-batch", "4"), out


def test_steps_at_capacity_decode_every_sequence_in_one_call(tmp_path):
    result = run_tiny(tmp_path / "capacity.json", "--variants", "paged")  # --step-batch capacity, the default
    settings, row = result["throughput"]["settings"], result["throughput"]["rows"]["paged"]
    assert row["status"] == "ok" and row["step_batch"] == settings["step_batch"]["paged"] >= row["sequences"] > 4
    assert row["calls_per_step"] == 1


def test_throughput_at_capacity_within_one_budget(tiny_throughput):
    result, out = tiny_throughput
    settings, rows = result["throughput"]["settings"], result["throughput"]["rows"]
    assert list(rows) == ["paged", "static", "paged-fp8"] and all(r["status"] == "ok" for r in rows.values())
    budget = 128 * 2**10
    token_bytes = 2 * 2 * 2 * 16 * 4  # tiny: 2 layers x K,V x 2 kv heads x D 16 x fp32
    assert settings["kv_bytes_per_token"] == {"paged": token_bytes, "static": token_bytes, "paged-fp8": token_bytes // 4}
    assert rows["static"]["sequences"] == settings["static_batch"] == budget // (64 * token_bytes) == 4
    for name in ("paged", "paged-fp8"):
        row = rows[name]
        # the build's pools are the budget's pages: the runtime's bytes per page is the arithmetic's
        assert row["pool_pages"] == settings["pool_pages"][name] == budget // (row["kv_bytes_per_token"] * 16)
        assert row["bytes_per_page"] == row["kv_bytes_per_token"] * 16
        assert row["capacity_pages"] <= row["pool_pages"] - 1  # the scratch page is never handed out
        assert row["capacity_tokens"] <= row["capacity_pages"] * 16
        assert row["bytes_held"] <= budget and row["sequences"] <= row["capacity_sequences"]
        assert row["calls_per_step"] == math.ceil(row["sequences"] / 4) and row["tokens_per_s"] > 0
    assert rows["paged-fp8"]["capacity_sequences"] > rows["paged"]["capacity_sequences"] > rows["static"]["sequences"]
    # on the CPU nothing is replayed, and the JSON says so; the static row has only its plain calls
    assert settings["cuda_graph"] is False and all(r["cuda_graph"] is False for r in rows.values())
    assert settings["step_batch"] == {"paged": 4, "paged-fp8": 4}
    static = rows["static"]
    assert static["tokens_per_s"] == static["plain_tokens_per_s"] and "graph_tokens_per_s" not in static
    saved = json.loads(out.read_text())
    assert saved["throughput"]["rows"].keys() == rows.keys() and "commit" in saved["environment"]
    assert saved["capacity"]["paged bf16"]["sequences"] == result["capacity"]["paged bf16"]["sequences"]


def test_fp8_recent_pages_serve_every_sequence_its_ring_slots_allow(tmp_path):
    """paged-fp8-recent (on request): the rings of --ring-slots slots come out of the budget
    before the pages, and the decoder holds at most slots - 1 sequences (one slot is the padding
    rows')."""
    result = run_tiny(tmp_path / "capacity.json", "--variants", "paged-fp8,paged-fp8-recent", "--ring-slots", "6",
                      "--step-batch", "4")
    settings, rows = result["throughput"]["settings"], result["throughput"]["rows"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    ring_bytes = 6 * 2 * 2 * 4 * 16 * (4 + 4)  # slots x layers x kv heads x 4 rows x D x (fp32 K + fp32 V)
    assert settings["ring_bytes"] == ring_bytes
    page_bytes = settings["kv_bytes_per_token"]["paged-fp8-recent"] * 16
    assert settings["pool_pages"]["paged-fp8-recent"] == (128 * 2**10 - ring_bytes) // page_bytes
    recent, plain = rows["paged-fp8-recent"], rows["paged-fp8"]
    assert recent["capacity_sequences"] == 5 < plain["capacity_sequences"]  # the slots, not the pages, ran out
    assert recent["tokens_per_s"] > 0 and recent["sequences"] <= 5
