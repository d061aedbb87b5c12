"""decode_attention with the step's cache write folded in (attrs "kv_write", from
fuse-kv-write-attention): the kernel writes rope(k_new) and v_new at the position, leaves every
other row alone, and attends over the written cache, whichever split holds the position and
whether the position is inside a sequence's length or past it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_attention import DEVICE, DTYPES, FAMILY, SMALL, SPLIT, check_close, make_inputs, make_region, reference, run_candidate
from test_decode_attention_rope import rope_tables, rotated, with_rope

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200


def folded(region: RegionSummary, k_rope: bool = True, positions: int = 1, shared_tables: bool = False,
           offsets: tuple[str, ...] = ()) -> RegionSummary:
    """`region` (with q's rope) taking the write's positions, k_new, v_new (in q's dtype; and K's
    cos, sin, unless it shares the query's, then the fp8 caches' `offsets` "k" / "v") last,
    returning the two caches before its output."""
    q, k, v = region.inputs[:3]
    batch, kv_heads, _, head_dim = k.shape
    new = TensorSpec((batch, kv_heads, 1, head_dim), q.dtype)
    tables = (TensorSpec((1, head_dim), q.dtype),) * 2 if k_rope and not shared_tables else ()
    at = len(region.inputs)
    centres = (TensorSpec((1, kv_heads, 1, head_dim), "float32"),) * len(offsets)
    inputs = (*region.inputs, TensorSpec((positions,), "int64"), new, new, *tables, *centres)
    write = {"positions_input": at, "rope": k_rope}
    write.update({f"{name}_offset_input": len(inputs) - len(offsets) + i for i, name in enumerate(offsets)})
    if k_rope:
        write["rope_tables_input"] = 4 if shared_tables else at + 3
    attrs = {**region.attrs, "kv_write": write, "inplace": [1, 2]}
    return dataclasses.replace(region, inputs=inputs, outputs=(k, v, *region.outputs), attrs=attrs)


def write_inputs(batch, kv_heads, head_dim, dtype, seed=5):
    """k_new, v_new [B, Hkv, 1, D] as transposed views of a projection's [B, 1, Hkv, D]."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 1, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
            for _ in "kv"]


CASES = {
    # the decode step: every sequence attends up to and including the new row
    "lengths = position + 1": (45, [46, 46, 46]),
    # the new row inside one sequence's keys, past another's, the last key of the third
    "mixed lengths": (32, [80, 17, 33]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("params", [SMALL, SPLIT], ids=["one-split-fma", "four-splits-dot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_writes_the_row_and_attends_to_it(case, params, dtype, load_candidate):
    position, lengths = CASES[case]
    base = with_rope(make_region(3, 4, 2, 80, 64, dtype), (1, 64))
    region = folded(base)
    q, k, v, lengths_t = make_inputs(make_region(3, 4, 2, 80, 64, dtype), lengths)
    cos, sin = rope_tables((1, 64), DTYPES[dtype])
    k_cos, k_sin = rope_tables((1, 64), DTYPES[dtype], seed=2)
    k_new, v_new = write_inputs(3, 2, 64, DTYPES[dtype])
    k_expected, v_expected = k.clone(), v.clone()
    k_expected[:, :, position] = rotated(k_new.float(), k_cos.float(), k_sin.float())[:, :, 0].to(k.dtype)
    v_expected[:, :, position] = v_new[:, :, 0]
    # the row's old contents must reach nothing: NaN there
    k[:, :, position], v[:, :, position] = float("nan"), float("nan")
    positions = torch.tensor([position], device=DEVICE)
    k_out, v_out, out = run_candidate(load_candidate, region, params,
                                      [q, k, v, lengths_t, cos, sin, positions, k_new, v_new, k_cos, k_sin])
    assert k_out.data_ptr() == k.data_ptr() and v_out.data_ptr() == v.data_ptr()  # written in place
    # the new K row: the rope in fp32 then rounded once to the cache's dtype (a bf16 ulp at most
    # apart, from where the fp32 products are fused)
    ulp = 1e-5 if dtype == "float32" else 8e-3
    torch.testing.assert_close(k_out.float(), k_expected.float(), rtol=ulp, atol=ulp)
    torch.testing.assert_close(v_out, v_expected, rtol=0, atol=0)
    others = torch.arange(80, device=DEVICE) != position
    torch.testing.assert_close(k_out[:, :, others], k_expected[:, :, others], rtol=0, atol=0)
    check_close(out, reference(base, rotated(q, cos, sin), k_expected, v_expected, lengths_t))


@pytest.mark.parametrize("params", [SMALL, SPLIT], ids=["one-split-fma", "four-splits-dot"])
@pytest.mark.parametrize("position", [12, 0], ids=["new-row-past-the-key", "new-row-the-only-key"])
def test_one_valid_key_gives_its_value_row_however_large_the_scores(params, position, load_candidate):
    """A sequence of length 1 attends to one key: its V row, exactly, whatever the scores (here
    ~1e6: q and K of magnitude 1000). Session 15: with the new row merged after the key loop, the
    H200 returned that row with half of each head's columns scaled by 2^(an ulp of the score)
    (0.77x); Triton's interpreter never showed it. Sequence 1 attends to 13 keys, the new one
    included when the position is 12."""
    base = with_rope(make_region(3, 4, 2, 80, 64, "float32"), (1, 64))
    region = folded(base)
    q, k, v, lengths = make_inputs(make_region(3, 4, 2, 80, 64, "float32"), [1, 13, 1])
    q, k = q * 1000, k * 1000
    cos, sin = rope_tables((1, 64), torch.float32)
    k_cos, k_sin = rope_tables((1, 64), torch.float32, seed=2)
    k_new, v_new = (x * 1000 for x in write_inputs(3, 2, 64, torch.float32))
    k_out, v_out, out = run_candidate(load_candidate, region, params,
                                      [q, k.clone(), v.clone(), lengths, cos, sin, torch.tensor([position], device=DEVICE),
                                       k_new, v_new, k_cos, k_sin])
    only_key = v_out[:, :, 0].repeat_interleave(2, dim=1)  # [B, H, D]: each query head's kv head's row 0
    for b in (0, 2):
        torch.testing.assert_close(out[b, :, 0], only_key[b], rtol=1e-6, atol=0)
    check_close(out[1:2], reference(base, rotated(q, cos, sin), k_out, v_out, lengths)[1:2])


def test_k_rotated_by_the_querys_tables(load_candidate):
    """The model gathers cos, sin once for q and k: the region takes them once (two inputs of one
    value would be drawn apart by verification), and the kernel rotates K by them."""
    base = with_rope(make_region(2, 8, 2, 64, 64, "float32"), (1, 64))
    region = folded(base, shared_tables=True)
    assert len(region.inputs) == 9 and FAMILY.matches(region)
    q, k, v, lengths = make_inputs(make_region(2, 8, 2, 64, 64, "float32"), [30, 64])
    cos, sin = rope_tables((1, 64), torch.float32)
    k_new, v_new = write_inputs(2, 2, 64, torch.float32)
    k_out, _, out = run_candidate(load_candidate, region, SPLIT,
                                  [q, k.clone(), v.clone(), lengths, cos, sin, torch.tensor([29], device=DEVICE), k_new, v_new])
    k[:, :, 29], v[:, :, 29] = rotated(k_new, cos, sin)[:, :, 0], v_new[:, :, 0]
    torch.testing.assert_close(k_out, k, rtol=1e-5, atol=1e-5)
    check_close(out, reference(base, rotated(q, cos, sin), k, v, lengths))


def test_a_write_without_k_rope(load_candidate):
    base = with_rope(make_region(2, 8, 2, 64, 64, "float32"), (1, 64))
    region = folded(base, k_rope=False)
    q, k, v, lengths = make_inputs(make_region(2, 8, 2, 64, 64, "float32"), [21, 21])
    cos, sin = rope_tables((1, 64), torch.float32)
    k_new, v_new = write_inputs(2, 2, 64, torch.float32)
    _, _, out = run_candidate(load_candidate, region, SPLIT,
                              [q, k.clone(), v.clone(), lengths, cos, sin, torch.tensor([20], device=DEVICE), k_new, v_new])
    k[:, :, 20], v[:, :, 20] = k_new[:, :, 0], v_new[:, :, 0]
    check_close(out, reference(base, rotated(q, cos, sin), k, v, lengths))


def test_matches_only_the_plain_folded_form():
    base = with_rope(make_region(2, 8, 2, 64, 64, "bfloat16"), (1, 64))
    region = folded(base)
    assert FAMILY.matches(region) and FAMILY.check(region, SPLIT, H200) is None
    source = FAMILY.render(region, SPLIT)
    # the new row stored before the key loop, which reads it back as any row (no mask of its own)
    assert source.index("tl.store(k_base + new_pos") < source.index("for block_start in tl.range")
    assert "key_ok = keys < end\n" in source and "keys != new_pos" not in source
    assert not FAMILY.matches(folded(base, positions=2))  # one position per sequence: not this form
    assert not FAMILY.matches(dataclasses.replace(region, outputs=region.outputs[2:]))  # the caches not returned
    no_inplace = {k: v for k, v in region.attrs.items() if k != "inplace"}
    assert not FAMILY.matches(dataclasses.replace(region, attrs=no_inplace))


def test_golden_rendering(golden):
    # a Llama-3-8B layer's: K rotated by the query's tables, read whole at the position
    region = gathered(folded(with_rope(make_region(1, 32, 8, 4096, 128, "bfloat16"), (1, 128)), shared_tables=True), 4096)
    golden("decode_attention_kv_write.py", FAMILY.render(region, {**SPLIT, "BLOCK_N": 128, "SPLIT_KV": 16}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_folded_kernels_compile_for_hopper(tmp_path):
    # Llama-3-8B's decode step (32 heads over 8 kv heads, D 128) at the advisor's split points:
    # the folded write must not stop the K/V loads from pipelining
    from template_helpers import compile_for_hopper

    base = make_region(2, 32, 8, "S", 128, "bfloat16", dims={"S": (1, 8192)})
    region = folded(with_rope(base, (1, 128)))
    q, k, v, lengths = make_inputs(base, [256, 100], {"S": 256})
    cos, sin = rope_tables((1, 128), torch.bfloat16)
    k_new, v_new = write_inputs(2, 8, 128, torch.bfloat16)
    inputs = [q, k, v, lengths, cos, sin, torch.tensor([99], device=DEVICE), k_new, v_new, cos, sin]
    points = {"split16": {"BLOCK_N": 128, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 2},
              "fma": {"BLOCK_N": 32, "SPLIT_KV": 1, "USE_DOT": False, "num_warps": 4, "num_stages": 2}}
    # and the Llama form: K rotated by the query's tables, read whole at the position
    llama = gathered(folded(with_rope(base, (1, 128)), shared_tables=True), 4096)
    tables = rope_tables((4096, 128), torch.bfloat16)
    llama_inputs = [q, k, v, lengths, *tables, torch.tensor([99], device=DEVICE), k_new, v_new]
    compiled = compile_for_hopper([(label, FAMILY.render(region, params), inputs) for label, params in points.items()]
                                  + [(f"gathered-{label}", FAMILY.render(llama, params), llama_inputs)
                                     for label, params in points.items()], tmp_path)
    for label in compiled:
        (kernel,) = compiled[label].values()
        assert kernel["pdl"] and kernel["pipelined"], label
    assert len(compiled) == 4


def gathered(region: RegionSummary, rows: int) -> RegionSummary:
    """`region` (folded) taking its rotary tables whole ([rows, D]) and reading their row at the
    write's position itself (attrs kv_write "gathered_tables")."""
    head_dim = region.inputs[0].shape[3]
    write = region.attrs["kv_write"]
    tables = {4, 5} | ({write["rope_tables_input"], write["rope_tables_input"] + 1} if write.get("rope") else set())
    inputs = tuple(TensorSpec((rows, head_dim), s.dtype) if i in tables else s for i, s in enumerate(region.inputs))
    return dataclasses.replace(region, inputs=inputs, attrs={**region.attrs, "kv_write": {**write, "gathered_tables": True}})


@pytest.mark.parametrize("shared", [False, True], ids=["own-k-tables", "shared-tables"])
@pytest.mark.parametrize("params", [SMALL, SPLIT], ids=["one-split-fma", "four-splits-dot"])
def test_whole_tables_are_read_at_the_position(shared, params, load_candidate):
    """A Llama step's cos[pos], sin[pos] gathers taken into the kernel: q and K rotated by row
    `position` of the whole tables, as the gathered rows would rotate them."""
    base = with_rope(make_region(3, 4, 2, 80, 64, "float32"), (1, 64))
    region = gathered(folded(base, shared_tables=shared), rows=96)
    assert FAMILY.matches(region) and FAMILY.check(region, params, H200) is None
    q, k, v, lengths = make_inputs(make_region(3, 4, 2, 80, 64, "float32"), [46, 12, 46])
    cos, sin = rope_tables((96, 64), torch.float32)
    k_cos, k_sin = (cos, sin) if shared else rope_tables((96, 64), torch.float32, seed=2)
    k_new, v_new = write_inputs(3, 2, 64, torch.float32)
    tables = [] if shared else [k_cos, k_sin]
    k_out, v_out, out = run_candidate(load_candidate, region, params, [q, k.clone(), v.clone(), lengths, cos, sin,
                                      torch.tensor([45], device=DEVICE), k_new, v_new, *tables])
    row = slice(45, 46)
    k[:, :, 45], v[:, :, 45] = rotated(k_new, k_cos[row], k_sin[row])[:, :, 0], v_new[:, :, 0]
    torch.testing.assert_close(k_out, k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_out, v, rtol=0, atol=0)
    check_close(out, reference(base, rotated(q, cos[row], sin[row]), k, v, lengths))


def test_whole_tables_need_the_head_dim():
    base = with_rope(make_region(1, 4, 2, 32, 64, "float32"), (1, 64))
    region = gathered(folded(base), rows=32)
    bad = dataclasses.replace(region, inputs=(*region.inputs[:4], TensorSpec((32, 32), "float32"), *region.inputs[5:]))
    assert FAMILY.matches(region) and not FAMILY.matches(bad)
