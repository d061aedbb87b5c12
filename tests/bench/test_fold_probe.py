"""bench/fold_probe.py without a GPU: on a folded decode attention region, the probe names the
row an output was read from, before or after the write, for a candidate that is right and for
one that attends over the caches before writing the new row (what a read racing the write gives)."""

from __future__ import annotations

from fold_probe import probe

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.verify.strategies import Example

B, H, HKV, S, D = 2, 4, 2, 32, 16
WRITE = "k_cache[:, :, pos], v_cache[:, :, pos] = k_new[:, :, 0], v_new[:, :, 0]"
ATTEND = """\
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype)
    for b in range(q.shape[0]):
        n = int(lengths[b])
        k = k_cache[b, :, :n].repeat_interleave(group, 0)
        v = v_cache[b, :, :n].repeat_interleave(group, 0)
        weights = torch.softmax(q[b] @ k.transpose(-1, -2) * 0.25, dim=-1)
        out[b] = weights @ v"""


def region() -> RegionSummary:
    q, cache, new = (TensorSpec(shape, "float32") for shape in ((B, H, 1, D), (B, HKV, S, D), (B, HKV, 1, D)))
    attrs = {"scale": 0.25, "num_heads": H, "num_kv_heads": HKV, "lengths_input": 3, "lengths_bound": [1, 2],
             "kv_write": {"positions_input": 4, "rope": False}, "inplace": [1, 2]}
    return RegionSummary("r0_decode_attention", "decode_attention",
                         inputs=(q, cache, cache, TensorSpec((B,), "int32"), TensorSpec((1,), "int64"), new, new),
                         outputs=(cache, cache, q), attrs=attrs)


def module(tmp_path, name: str, write_first: bool):
    """run(): write then attend, or (a read that beats the write) attend then write."""
    steps = [f"    {WRITE}", ATTEND] if write_first else [ATTEND, f"    {WRITE}"]
    body = "\n".join(steps)
    source = f"import torch\n\n\ndef run(q, k_cache, v_cache, lengths, positions, k_new, v_new):\n" \
             f"    pos = int(positions[0])\n{body}\n    return k_cache, v_cache, out\n"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return path


def test_the_probe_names_the_row_read(tmp_path):
    reference = module(tmp_path, "reference", write_first=True)
    racing = module(tmp_path, "racing", write_first=False)
    # magnitude 1000: a one-hot softmax, each output one V row. The first seeds whose new row or
    # old row is some head's top key (so that reading one for the other shows)
    found = []
    for seed in range(64):
        example = Example((), seed=seed, magnitude=1000.0).to_json()
        outcome = probe(region().to_json(), reference, racing, example, "cpu")
        if outcome["first_run_err"] > 1.0:
            found.append((example, outcome))
    assert found, "no seed of 64 makes the new row matter"
    example, outcome = found[0]
    b = outcome["worst"][0]
    position = outcome["position"][0]
    assert position < outcome["lengths"][b]  # the new row is among b's keys
    assert outcome["second_run_err"] < 1e-6  # over the written caches the racing read is right
    if outcome["reference_row"] == position:  # the new row was the top key: read as it was before
        assert outcome["candidate_row_written_cache"][0] != position
    else:  # the old row was: the output is its V row, from the cache before the write
        assert outcome["candidate_row_cache_before_write"][0] == position
    right = probe(region().to_json(), reference, reference, example, "cpu")
    assert right["first_run_err"] < 1e-6 and right["candidate_row_written_cache"][0] == right["reference_row"]


def test_a_repro_without_a_folded_write_is_named_with_its_failure_not_probed(tmp_path, monkeypatch, capsys):
    """A folded build's unfolded regions can fail too (session 18: the first repro the GPU step
    found was an unfolded build's attention): main names it with its build-time failure and goes on."""
    import dataclasses

    from fold_probe import main

    from coopt.verify.repro import write_repro

    unfolded = dataclasses.replace(region(), attrs={k: v for k, v in region().attrs.items() if k != "kv_write"})
    reference = module(tmp_path, "reference", write_first=True)
    scripts = [write_repro(summary, reference, reference, Example((), seed=3, magnitude=1000.0),
                           repro_dir=tmp_path / "repro", label=label, failure=f"output 2: max abs err {label}")
               for summary, label in ((unfolded, "c0"), (region(), "c1"))]
    monkeypatch.setattr("sys.argv", ["fold_probe.py", *map(str, scripts), "--device", "cpu"])
    assert main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("no cache write folded in; at build time: output 2: max abs err c0")
    assert "'first_run_err': 0.0" in lines[1]
