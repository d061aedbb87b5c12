"""`coopt build examples/llama/model.py --kv-cache fp8-recent` on the tiny preset (fp8 caches,
keys centred, each query's newest 4 keys unrounded from a ring beside each cache): one CLI build
(decode step + prefill entry, --top-k 1). The decode step's attention computes its own rows from
the folded write (no rope, centring or write launch of their own), the prefill's write outputs
the rows it rounds, and every kernel is judged against the build's own reference program."""

from __future__ import annotations

import json

import pytest
import torch

import coopt
from llama_helpers import DEVICE, cli_build

CACHES = [f"layers.{layer}.attention.{kind}_cache" for layer in range(2) for kind in "kv"]


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_fp8_recent") / "out"
    cli_build(out, "--kv-cache", "fp8-recent")
    assert "fp8-kv-cache{smooth-k=true,exact-recent=4}," in json.loads((out / "build.json").read_text())["pipeline"]
    return out


def test_the_decode_step_folds_the_write_and_its_exact_rows_into_the_attention(built_dir):
    regions = json.loads((built_dir / "selection.json").read_text())["regions"]
    families = {r["family"] for r in regions.values()}
    assert "kv_write" not in families  # K's rope, centring and the write are the attention's
    assert all(r["summary"]["inputs"][0]["shape"][1] == 4 for r in regions.values() if r["family"] == "rope")  # q's only
    attentions = [r for r in regions.values() if r["family"] == "decode_attention"]
    assert len(attentions) == 2 and all(r["selected"] != "reference" for r in attentions)
    for region in attentions:
        attrs, inputs = region["summary"]["attrs"], region["summary"]["inputs"]
        assert attrs["exact_rows"] == "folded" and attrs["recent"] == 4 and attrs["kv_write"]["rope"]
        assert attrs["inplace"] == [1, 2, attrs["rings_input"], attrs["rings_input"] + 1]
        assert [t["shape"][2] for t in inputs[attrs["rings_input"]:]] == [4, 4]
    report = (built_dir / "report.md").read_text()
    assert "aten.sub.Tensor" not in report.split("## Regions")[0]  # no centring left outside a region
    check = json.loads((built_dir / "build.json").read_text())["end_to_end"]["kernels_vs_reference_program"]
    assert check["ok"] and check["max_abs_err"] < 1e-3


def test_the_prefill_write_outputs_the_keys_it_rounds(built_dir):
    prefill = json.loads((built_dir / "entries" / "prefill" / "selection.json").read_text())["regions"]
    writes = [r for r in prefill.values() if r["family"] == "kv_write"]
    assert len(writes) == 2 and all(r["selected"] != "reference" for r in writes)
    for region in writes:
        attrs, outputs = region["summary"]["attrs"], region["summary"]["outputs"]
        assert attrs["rope"] and attrs["k_offset"] and attrs["exact_outputs"] == ["k"]
        assert outputs[-1]["dtype"] == "float32"  # the centred keys
    assert not [r for r in prefill.values() if r["family"] == "rope" and r["summary"]["inputs"][0]["shape"][1] != 4]


def test_the_rings_are_state_and_generate_runs(built_dir):
    main = torch.load(built_dir / "weights.pt", weights_only=True, map_location="cpu")
    for name in CACHES:
        ring = main[name + ".recent"]
        assert ring.shape == (1, 2, 4, 16) and main[name].dtype == torch.float8_e4m3fn
    built = coopt.load(built_dir)
    prompt = torch.tensor([[3, 17, 42, 9]], device=DEVICE)
    tokens = coopt.generate(built, prompt, 6)
    assert tokens.shape == (1, 10) and torch.equal(tokens[:, :4], prompt)
