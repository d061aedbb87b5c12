"""kv_write in paged mode (paged-kv): the rows go into page pools [N, Hkv, P, D] through a page
table, per row (a ragged decode step) or per token (a prompt over the pages), against torch
indexing; pages the table does not name stay untouched. Per-token fp8: each row's scale goes to
the same page and row of the scale pools [N, Hkv, P]."""

from __future__ import annotations

import pytest
import torch
from template_helpers import on_test_device

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.kv_write import KvWriteFamily

FAMILY = KvWriteFamily()
FP8 = torch.float8_e4m3fn


def region(pages, heads, page_size, b, t, d, max_pages, *, per_row=True, rope=False, quant="none", dtype="float32"):
    pool = TensorSpec((pages, heads, page_size, d), "float8_e4m3fn" if quant != "none" else dtype)
    row = TensorSpec((b, heads, t, d), dtype)
    inputs = [pool, pool, TensorSpec((b if per_row else t,), "int64"), row, row]
    if rope:
        inputs += [TensorSpec((b, 1, t, d) if per_row else (t, d), "float32")] * 2
    inplace = [0, 1]
    if quant == "per-token":  # scale pools, written in place beside the pages
        inputs += [TensorSpec((pages, heads, page_size), "float32")] * 2
        inplace += [len(inputs) - 2, len(inputs) - 1]
    elif quant != "none":
        inputs += [TensorSpec((1,) if quant == "per-tensor" else (heads,), "float32")] * 2
    inputs.append(TensorSpec((b, max_pages), "int32"))
    attrs = {"rope": rope, "quant": quant, "inplace": inplace, "page_size": page_size,
             "page_table_input": len(inputs) - 1, "pool_input": 0}
    if quant == "per-token":
        attrs["headroom"] = 1.25
    if per_row:
        attrs.update({"positions": "per-row", "index_input": 2, "index_bound": [len(inputs) - 1, 1]})
    return RegionSummary("kv", "kv_write", tuple(inputs), tuple(inputs[i] for i in inplace), attrs)


def reference(summary, inputs):
    """The paged write as paged-kv builds it: page_ids = table[rows | :, pos // P], slots = pos % P."""
    k_pages, v_pages, positions, k, v, *extra = [t.clone() for t in inputs]
    table, extra = extra[-1], extra[:-1]
    size, quant = summary.attrs["page_size"], summary.attrs["quant"]
    if summary.attrs["rope"]:
        cos, sin, *extra = extra
        half = k.shape[-1] // 2
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
    written = [(k_pages, k), (v_pages, v)]
    if quant == "per-token":  # fp8-kv-cache's scales: max(absmax(row), 1e-12) * headroom / 448
        scales = [x.float().abs().amax(-1).clamp_min(1e-12) * (summary.attrs["headroom"] / 448) for x in (k, v)]
        k, v = ((x.float() / s[..., None]).clamp(-448, 448).to(FP8) for x, s in zip((k, v), scales))
        written = [(k_pages, k), (v_pages, v), *zip(extra, scales)]
    elif quant != "none":
        shape = (1, 1, 1, 1) if quant == "per-tensor" else (1, -1, 1, 1)
        k = (k.float() / extra[0].view(shape)).clamp(-448, 448).to(FP8)
        v = (v.float() / extra[1].view(shape)).clamp(-448, 448).to(FP8)
        written = [(k_pages, k), (v_pages, v)]
    for pages, x in written:  # (scales: [B, Hkv, T] into [N, Hkv, P], the same indices)
        if summary.attrs.get("positions") == "per-row":
            ids = table[torch.arange(x.shape[0]), positions // size]
            torch.ops.aten.index_put_.default(pages, [ids, None, positions % size], x[:, :, 0])
        else:
            ids = table[:, positions // size]
            torch.ops.aten.index_put_.default(pages, [ids, None, positions % size], x.transpose(1, 2))
    return tuple(pages for pages, _ in written)


def make(summary, positions, table, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for i, spec in enumerate(summary.inputs):
        if i == 2:
            tensors.append(torch.tensor(positions, dtype=torch.int64))
        elif i == len(summary.inputs) - 1:
            tensors.append(torch.tensor(table, dtype=torch.int32))
        else:
            values = torch.randn(spec.shape, generator=generator)
            if spec.dtype == "float8_e4m3fn":
                values = values.clamp(-448, 448).to(FP8)
            elif summary.attrs["quant"] != "none" and i >= len(summary.inputs) - 3:
                values = values.abs() * 0.05 + 0.01  # (per-token: what the pools held before)
            tensors.append(values)
    return tensors


def check(load_candidate, summary, positions, table, params=None):
    inputs = make(summary, positions, table)
    expected = reference(summary, inputs)
    module = load_candidate(FAMILY.render(summary, params or FAMILY.legal_points(summary, H200)[0]))
    outputs = module.run(*on_test_device([t.clone() for t in inputs]))
    for got, want in zip(outputs, expected):
        if got.dtype == FP8:
            assert torch.equal(got.cpu().float(), want.float())
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=2e-6, atol=2e-6)
    return inputs, outputs


# three sequences over a pool of 8 pages of 16 positions, up to 3 pages each, scattered
TABLE = [[5, 2, 7], [0, 6, 1], [3, 4, 0]]


@pytest.mark.parametrize("rope_on", [False, True])
def test_each_row_writes_through_its_page_table(load_candidate, rope_on):
    summary = region(8, 2, 16, 3, 1, 16, 3, rope=rope_on)
    inputs, outputs = check(load_candidate, summary, [17, 0, 47], TABLE)
    touched = {(2, 1), (0, 0), (0, 15)}  # (page, row): 17 -> page 2 row 1; 0 -> page 0 row 0; 47 -> page 0 row 15
    for page in range(8):
        for slot in range(16):
            if (page, slot) not in touched:
                assert torch.equal(outputs[0].cpu()[page, :, slot], inputs[0][page, :, slot])


def test_a_prompt_writes_every_row_through_the_table(load_candidate):
    summary = region(8, 2, 16, 2, 5, 16, 3, per_row=False, rope=True)
    check(load_candidate, summary, [14, 15, 16, 17, 40], TABLE[:2])


@pytest.mark.parametrize("params", FAMILY.legal_points(region(8, 2, 16, 3, 1, 16, 3, rope=True), H200)[:4],
                         ids=lambda p: f"R{p['BLOCK_R']}w{p['num_warps']}")
def test_points(load_candidate, params):
    check(load_candidate, region(8, 2, 16, 3, 1, 16, 3, rope=True), [1, 33, 20], TABLE, params)


@pytest.mark.parametrize("quant", ["per-tensor", "per-head", "per-token"])
def test_fp8_pages(load_candidate, quant):
    check(load_candidate, region(8, 2, 16, 3, 1, 16, 3, rope=True, quant=quant), [9, 31, 32], TABLE)


@pytest.mark.parametrize("per_row,positions", [(True, [15, 16, 47]), (False, [14, 15, 16, 17, 40])],
                         ids=["ragged-step", "prompt"])
def test_per_token_scales_go_to_each_rows_page_and_slot(load_candidate, per_row, positions):
    """Bit-exact rows and scales (pools compared whole: nothing else changes), an all-zero head
    (its scale the floor, zeros stored) and an outlier (the row's largest element stored as
    448 / headroom rounded to e4m3)."""
    batch = 3 if per_row else 2
    # No rope: its fp32 products round differently on a GPU (fused multiply-adds), which moves a
    # row's absmax, so its scale, by an ulp (session 10's GPU run); test_fp8_pages has rope with
    # per-token pages, compared at a tolerance.
    summary = region(8, 2, 16, batch, 1 if per_row else 5, 16, 3, per_row=per_row, rope=False, quant="per-token")
    inputs = make(summary, positions, TABLE[:batch], seed=5)
    inputs[3][0, 1] = 0.0  # sequence 0's kv head 1: all zeros
    inputs[4][-1, 0, :, 3] = 1e4  # an outlier in V's rows
    expected = reference(summary, inputs)
    module = load_candidate(FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]))
    outputs = module.run(*on_test_device([t.clone() for t in inputs]))
    assert [o.dtype for o in outputs] == [FP8, FP8, torch.float32, torch.float32]
    for got, want in zip(outputs, expected):
        assert torch.equal(got.cpu().float(), want.float())
    page, slot = TABLE[0][positions[0] // 16], positions[0] % 16
    assert outputs[2][page, 1, slot] == torch.tensor(1e-12 * 1.25 / 448) and not outputs[0][page, 1, slot].float().any()
    page, slot = TABLE[batch - 1][positions[-1] // 16], positions[-1] % 16
    assert outputs[1][page, 0, slot, 3] == torch.tensor(448 / 1.25).to(FP8)  # (352 in e4m3)
    assert outputs[3][page, 0, slot] == torch.tensor(1e4) * (1.25 / 448)


def test_positions_past_the_table_are_not_written(load_candidate):
    summary = region(8, 2, 16, 3, 1, 16, 3)
    inputs = make(summary, [48, -1, 3], TABLE)
    module = load_candidate(FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]))
    outputs = module.run(*on_test_device([t.clone() for t in inputs]))
    changed = (outputs[0].cpu() != inputs[0]).any(-1).any(1).nonzero().tolist()
    assert changed == [[3, 3]]  # only row 2's position 3: page 3, row 3


def test_matches_the_paged_schema_only():
    assert FAMILY.matches(region(8, 2, 16, 3, 1, 16, 3, rope=True))
    assert FAMILY.matches(region(8, 2, 16, 2, 5, 16, 3, per_row=False, quant="per-head"))
    per_token = region(8, 2, 16, 3, 1, 16, 3, quant="per-token")
    assert FAMILY.matches(per_token)
    # per-token scales are pools shaped like the pages, [N, Hkv, P]
    unpaged_scales = (*per_token.inputs[:5], *(TensorSpec((3, 2, 48), "float32"),) * 2, per_token.inputs[-1])
    assert not FAMILY.matches(RegionSummary("kv", "kv_write", unpaged_scales, per_token.outputs, per_token.attrs))
    good = region(8, 2, 16, 3, 1, 16, 3)
    wrong_size = RegionSummary("kv", "kv_write", good.inputs, good.outputs, {**good.attrs, "page_size": 32})
    int64_table = RegionSummary("kv", "kv_write", (*good.inputs[:-1], TensorSpec((3, 3), "int64")), good.outputs, good.attrs)
    assert not FAMILY.matches(wrong_size) and not FAMILY.matches(int64_table)


def test_compiles_for_hopper(compile_for_sm90):
    jobs = []
    for quant in ("per-head", "per-token"):
        summary = region(8, 2, 16, 3, 1, 32, 3, rope=True, quant=quant, dtype="bfloat16")
        inputs = [t.to(torch.bfloat16) if t.dtype == torch.float32 and t.dim() == 4 and t.shape[1] == 2 else t
                  for t in make(summary, [0, 5, 40], TABLE)]
        jobs.append((quant, FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]), inputs, "kv_write_kernel"))
    compile_for_sm90(jobs)
