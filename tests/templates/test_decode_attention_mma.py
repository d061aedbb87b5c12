"""decode_attention_mma: the CUDA fp8 decode attention. On the CPU: which regions it takes, that it
offers no point without a GPU (its candidates are verified on one), that every form compiles for
sm_90a without spills (nvcc, where installed), how its blocks meet (read from the PTX), which q
and table views its module copies, and that the module refuses CPU tensors clearly.
On the GPU (@pytest.mark.gpu): agreement with an fp32-softmax reference over drawn batches,
lengths and heads, the folded cache write stored as the kv_write template stores it, repeated
launches (the merge's counters reset), strided and misaligned q, and NaN bytes past a length
never reaching the output."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_attention import (E4M3_MAX, FAMILY, fp8_reference, fp8_region, make_fp8_inputs, make_inputs,
                                   make_paged_inputs, make_region, paged_region, reference)
from test_decode_attention_kv_write import folded, write_inputs
from test_decode_attention_rope import rope_tables, rotated, with_rope

from coopt.ir.region import TensorSpec
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import AdviceRequest
from coopt.targets import H200
from coopt.templates import base as template_base
from coopt.templates.decode_attention_mma import DecodeAttentionMmaFamily, shared_bytes
from coopt.templates.registry import families_for
from coopt.verify.profiles import resolve_profile
from template_helpers import kernel_source

MMA = DecodeAttentionMmaFamily()
ADVISED = {"SPLIT": 16, "CHUNK": 32, "COPY": "ca", "num_warps": 8, "num_stages": 2, "MEET": "global"}
SMALL = {"SPLIT": 1, "CHUNK": 16, "COPY": "cg", "num_warps": 4, "num_stages": 3, "MEET": "global"}
FORMS = {"advised": ADVISED, "small": SMALL, "split 4 chunk 16 ca": {**ADVISED, "SPLIT": 4, "CHUNK": 16},
         "cluster of 8": {**ADVISED, "SPLIT": 8, "CHUNK": 16, "MEET": "cluster"}}


def plain(batch=1, heads=32, kv_heads=8, max_length=4096, granularity="per-head"):
    return fp8_region(batch, heads, kv_heads, max_length, 128, granularity)


def plain_bf16(batch=1, heads=32, kv_heads=8, max_length=4096):
    return make_region(batch, heads, kv_heads, max_length, 128, "bfloat16")


def folded_bf16(batch=2, heads=32, kv_heads=8, max_length=512, gathered=False):
    """fuse-kv-write-attention's region over a bf16 cache: query rope, the write with K's rope."""
    return gather_tables(folded(with_rope(plain_bf16(batch, heads, kv_heads, max_length), (1, 128))), gathered)


def gather_tables(region, gathered):
    """The region reading whole [S, D] rotary tables at the write's position, where `gathered`."""
    if not gathered:
        return region
    tables = TensorSpec((region.inputs[1].shape[2], 128), "bfloat16")
    at = region.attrs["kv_write"]["rope_tables_input"]
    inputs = list(region.inputs)
    inputs[4] = inputs[5] = inputs[at] = inputs[at + 1] = tables
    return dataclasses.replace(region, inputs=tuple(inputs), attrs={
        **region.attrs, "kv_write": {**region.attrs["kv_write"], "gathered_tables": True}})


def folded_fp8(batch=2, heads=32, kv_heads=8, max_length=512, offsets=("k",), gathered=False, granularity="per-head"):
    """fuse-kv-write-attention's region over an fp8 cache: query rope, the write with K's rope and offsets."""
    attention = fp8_region(batch, heads, kv_heads, max_length, 128, granularity)
    return gather_tables(folded(with_rope(attention, (1, 128)), offsets=offsets), gathered)


# where the folded write's row falls: (position, the two sequences' lengths). The warp whose chunk
# holds the row writes it into its ring slot; where a sequence's keys do not reach it, warp 0 of
# the last split stores it
WRITES = {
    "the last key, past sequence 1's": (300, [301, 120]),
    "a chunk's last row, inside sequence 1's keys": (255, [256, 300]),
    "row 0": (0, [1, 5]),
}


@pytest.fixture
def gpu_points(monkeypatch):
    """As on a GPU machine: the family offers points."""
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: True)


def values_only(region):
    """fp8-kv-cache{values-only}'s form of an fp8 region: K in bf16 beside the e4m3 V."""
    keys = TensorSpec(region.inputs[1].shape, "bfloat16")
    return dataclasses.replace(region, inputs=(region.inputs[0], keys, *region.inputs[2:]))


def folded_values(batch=2, heads=32, kv_heads=8, max_length=512, gathered=False):
    """fuse-kv-write-attention's region over a values-only cache: query rope, K's rope, V's offset."""
    attention = values_only(fp8_region(batch, heads, kv_heads, max_length, 128, "per-head"))
    return gather_tables(folded(with_rope(attention, (1, 128)), offsets=("v",)), gathered)


def test_it_takes_fp8_caches_with_scalar_scales_or_bf16_caches_and_128_wide_rows(gpu_points):
    assert MMA.matches(plain()) and MMA.matches(folded_fp8()) and MMA.matches(folded_fp8(gathered=True))
    assert MMA.matches(values_only(plain())) and MMA.matches(folded_values())
    assert MMA.matches(plain_bf16()) and MMA.matches(folded_bf16()) and MMA.matches(paged_bf16(16))
    assert MMA.matches(plain(granularity="per-tensor")) and MMA.matches(plain(heads=56, kv_heads=8))  # group 7
    assert MMA.matches(paged(16)) and MMA.matches(paged(64))
    bf16_with_scales = fp8_region(1, 32, 8, 4096, 128, "per-head", cache_dtype="bfloat16")
    keys_fp8_values_bf16 = dataclasses.replace(plain(), inputs=(*plain().inputs[:2], TensorSpec((1, 8, 4096, 128), "bfloat16"),
                                                                *plain().inputs[3:]))
    refused = {
        "per-token scales": plain(granularity="per-token"),
        "head dim 64": fp8_region(1, 32, 8, 4096, 64, "per-head"),
        "group 16": plain(heads=128, kv_heads=8),
        "bf16 query": fp8_region(1, 32, 8, 4096, 128, "per-head", dtype="float16"),
        "a bf16 cache with scales": bf16_with_scales,
        "fp8 keys beside bf16 values": keys_fp8_values_bf16,
        "values-only, per-token scales": values_only(plain(granularity="per-token")),
        "fp16 caches": make_region(1, 32, 8, 4096, 128, "float16"),
        "bf16, head dim 64": make_region(1, 32, 8, 4096, 64, "bfloat16"),
    }
    assert [name for name, region in refused.items() if MMA.matches(region)] == []
    # both families offer candidates for the same region; the build measures them side by side
    assert {f.name for f in families_for(plain())} == {"decode_attention", "decode_attention_mma"}


def test_no_point_without_a_gpu_and_every_space_point_checked(monkeypatch):
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: False)
    assert MMA.legal_points(plain(), H200) == []
    assert "NVIDIA GPU" in MMA.check(plain(), ADVISED, H200)
    monkeypatch.setattr(template_base, "cuda_runs_here", lambda: True)
    points = MMA.legal_points(plain(), H200)
    assert ADVISED in points and SMALL in points
    assert MMA.check(plain(), {**ADVISED, "SPLIT": 64}, H200) == "SPLIT=64 is not in the space"
    small_smem = dataclasses.replace(H200, smem_per_block_bytes=100 * 1024)
    assert "shared memory" in MMA.check(plain(), ADVISED, small_smem)  # 8 rings of 2 x 8 KiB slots
    assert MMA.check(plain(), {**ADVISED, "num_warps": 4}, small_smem) is None
    assert "Hopper" in MMA.check(plain(), ADVISED, dataclasses.replace(H200, arch="sm_80"))
    assert shared_bytes(ADVISED, 4) == 8 * 2 * 2 * 32 * 128 + 4 * (8 * 4 * 130 + 2 * 16 * 4) + 16
    # bf16 rows are twice the bytes: 8 warps' rings of 2 slots of 32-key chunks no longer fit
    assert "shared memory" in MMA.check(plain_bf16(), ADVISED, H200)
    assert MMA.check(plain_bf16(), {**ADVISED, "CHUNK": 16}, H200) is None
    # values-only: 256-byte K rows and 128-byte V rows a key
    assert shared_bytes(ADVISED, 4, 2, 1) == 8 * 2 * 32 * (256 + 128) + 4 * (8 * 4 * 130 + 2 * 16 * 4) + 16
    assert MMA.check(values_only(plain()), {**ADVISED, "CHUNK": 16}, H200) is None


@pytest.mark.parametrize(("batch", "length", "split"), [(1, 32768, 16), (1, 131072, 16), (1, 2048, 8)])
def test_the_heuristic_fills_the_sms_through_the_l1_at_8_warps(gpu_points, batch, length, split):
    region = plain(batch=batch, max_length=length)
    legal = tuple(MMA.legal_points(region, H200))
    request = AdviceRequest(region, MMA.name, MMA.param_space(region, H200), legal, H200.facts(), 3)
    ranked = HeuristicAdvisor().advise(request).ranked
    assert ranked[0] == {"SPLIT": split, "CHUNK": 16, "COPY": "ca", "num_warps": 8, "num_stages": 2, "MEET": "global"}
    # the same point meeting in a cluster where its splits make one (not yet measured in a build),
    # else 32-key chunks (measured second in every build, session 28)
    assert ranked[1] == ({**ranked[0], "MEET": "cluster"} if split <= 8 else {**ranked[0], "CHUNK": 32})


@pytest.mark.parametrize(("length", "split"), [(2048, 16), (32768, 16), (256, 2)])
def test_a_bf16_split_takes_the_bytes_of_an_fp8_one(gpu_points, length, split):
    """At least 32 KiB of each cache a split: 128 bf16 keys (256 fp8 keys)."""
    region = plain_bf16(max_length=length)
    legal = tuple(MMA.legal_points(region, H200))
    request = AdviceRequest(region, MMA.name, MMA.param_space(region, H200), legal, H200.facts(), 3)
    ranked = HeuristicAdvisor().advise(request).ranked
    assert ranked[0] == {"SPLIT": split, "CHUNK": 16, "COPY": "ca", "num_warps": 8, "num_stages": 2, "MEET": "global"}


@pytest.mark.parametrize("length", [2048, 32768])
def test_short_splits_rank_the_largest_cluster_second(gpu_points, length):
    """b1 / 2048 bf16: 16 splits of 128 keys, whose global meeting is a fixed cost; 8 splits in a
    cluster ran 7.11 µs folded against 7.52 on the H200 (session 37), so a build measures it. At
    32768 the splits hold 2048 keys each and 8 in a cluster lost (25.93 against 21.90 fp8): no
    cluster among a build's first three."""
    region = plain_bf16(max_length=length)
    legal = tuple(MMA.legal_points(region, H200))
    request = AdviceRequest(region, MMA.name, MMA.param_space(region, H200), legal, H200.facts(), 3)
    ranked = HeuristicAdvisor().advise(request).ranked
    assert ranked[0]["SPLIT"] == 16 and ranked[0]["MEET"] == "global"
    if length == 2048:
        assert ranked[1] == {**ranked[0], "SPLIT": 8, "MEET": "cluster"}
    else:
        assert all(point["MEET"] == "global" for point in ranked[:3])


def test_more_blocks_than_sms_rank_4_warps_first(gpu_points):
    """b32: 256 (sequence, kv head) blocks on 132 SMs, one block an SM at 8 warps: two waves; at 4
    warps three blocks an SM, one wave (session 28: 36.8 µs against session 26's 47.3 at 8)."""
    region = plain(batch=32, max_length=2048)
    legal = tuple(MMA.legal_points(region, H200))
    request = AdviceRequest(region, MMA.name, MMA.param_space(region, H200), legal, H200.facts(), 3)
    ranked = HeuristicAdvisor().advise(request).ranked
    assert ranked[0] == {"SPLIT": 1, "CHUNK": 16, "COPY": "ca", "num_warps": 4, "num_stages": 2, "MEET": "global"}
    assert ranked[1] == {**ranked[0], "CHUNK": 32}
    first_8_warps = next(i for i, point in enumerate(ranked) if point["num_warps"] == 8)
    assert first_8_warps > 2  # past a build's top 3


def test_the_heuristic_plans_a_paged_cache_at_what_its_table_addresses(gpu_points):
    region = paged(64, batch=1, max_pages=512)  # 32768 positions through the table, pages of 64
    legal = tuple(MMA.legal_points(region, H200))
    request = AdviceRequest(region, MMA.name, MMA.param_space(region, H200), legal, H200.facts(), 3)
    assert HeuristicAdvisor().advise(request).ranked[0]["SPLIT"] == 16  # not the page's 64 positions


def paged(page_size, batch=3, max_pages=8):
    """decode_attention through a page table over a shuffled pool of fp8 pages, per-head scales."""
    return paged_region(batch, 32, 8, batch * max_pages + 2, page_size, max_pages, 128, "bfloat16", "per-head")


def paged_bf16(page_size, batch=3, max_pages=8):
    """decode_attention through a page table over a shuffled pool of bf16 pages."""
    return paged_region(batch, 32, 8, batch * max_pages + 2, page_size, max_pages, 128, "bfloat16")


REGIONS = {
    "plain per-head": plain(),
    "plain per-tensor, int64 lengths": dataclasses.replace(
        plain(granularity="per-tensor"), inputs=(*plain().inputs[:3], TensorSpec((1,), "int64"), *plain().inputs[4:])),
    "folded, smooth-k": folded_fp8(),
    "folded, gathered tables, smooth-k and smooth-v": folded_fp8(offsets=("k", "v"), gathered=True),
    "paged, pages of 16": paged(16),
    "bf16 plain": plain_bf16(),
    "bf16 folded, gathered tables": folded_bf16(gathered=True),
    "bf16 paged, pages of 16": paged_bf16(16),
    "values-only plain": values_only(plain()),
    "values-only folded, gathered tables, smooth-v": folded_values(gathered=True),
    "values-only paged, pages of 16": values_only(paged(16)),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("region", REGIONS)
def test_every_form_compiles_for_hopper_without_spills(hopper_registers, region, form):
    bf16 = REGIONS[region].inputs[1].dtype == "bfloat16"  # bf16 keys: forms at 16-key chunks (BF16_FORMS)
    params = (BF16_FORMS if bf16 else FORMS)[form]
    # one block of the form's warps an SM, whatever its registers
    assert hopper_registers(kernel_source(MMA.render(REGIONS[region], params))) * 32 * params["num_warps"] <= 65536


@pytest.mark.parametrize("region", ["plain per-head", "paged, pages of 16"])
def test_its_rings_start_on_a_128_byte_boundary(hopper_static_shared, region):
    """No static __shared__ (the merge's flag sits after its sums): one would move the rings off a
    128-byte boundary, where a cp.async's write takes twice the wavefronts (session 31)."""
    assert hopper_static_shared(kernel_source(MMA.render(REGIONS[region], ADVISED))) == 0


def test_one_split_writes_its_output_without_the_global_meeting(hopper_ptx):
    """At SPLIT 1 a block is its (sequence, kv head)'s only one: no partials or arrival count. Split,
    the blocks meet by one thread's acq_rel count after a block barrier, with no fence in every
    thread."""
    arrival = "atom.acq_rel.gpu.global.add.s32"
    many = hopper_ptx(kernel_source(MMA.render(plain(), ADVISED)))
    one = hopper_ptx(kernel_source(MMA.render(plain(batch=32), {**ADVISED, "SPLIT": 1, "num_warps": 4})))
    assert many.count(arrival) == 1 and arrival not in one
    assert "membar.gl" not in many and "fence." not in many


@pytest.mark.parametrize("region", ["plain per-head", "bf16 folded, gathered tables"])
def test_a_cluster_of_splits_meets_in_distributed_shared_memory(hopper_ptx, region):
    """MEET=cluster: the splits of a (sequence, kv head) are one cluster (.reqnctapercluster), read
    each other's partials through ld.shared::cluster between two cluster barriers, and touch no
    global partials or arrival count."""
    params = FORMS["cluster of 8"]
    ptx = hopper_ptx(kernel_source(MMA.render(REGIONS[region], params)))
    assert ".reqnctapercluster 8, 1, 1" in ptx
    assert ptx.count("barrier.cluster.arrive") == 2 and "ld.shared::cluster" in ptx and "mapa" in ptx
    assert "atom." not in ptx and "ld.global.cg.f32" not in ptx


def test_a_cluster_takes_2_to_8_splits(gpu_points):
    cluster = FORMS["cluster of 8"]
    assert MMA.check(plain(), cluster, H200) is None and MMA.check(plain(), {**cluster, "SPLIT": 2}, H200) is None
    for split in (1, 16):
        assert "2 to 8 splits" in MMA.check(plain(), {**cluster, "SPLIT": split}, H200)
    # a point without the knob (an older cache's) meets in global memory
    assert MMA.check(plain(), {k: v for k, v in ADVISED.items() if k != "MEET"}, H200) is None
    assert shared_bytes(cluster, 4) == shared_bytes({**cluster, "MEET": "global"}, 4) + 4 * 4 * 130
    assert {point["MEET"] for point in MMA.legal_points(plain(), H200)} == {"global", "cluster"}


@pytest.mark.parametrize(("split", "warps", "in_registers"), [(16, 8, True), (32, 4, False)])
def test_the_last_block_loads_every_partial_before_it_waits(hopper_ptx, split, warps, in_registers):
    """Where a thread's partials fit in 64 registers (OUTPUTS_PER_THREAD x SPLIT), the merge issues
    all its L2 loads (accumulators, then (m, l)) before the block barrier that waits for the
    weights: one round trip. Past that (group 4 at 4 warps and 32 splits: 4 x 32) it loads the
    accumulators after the weights, as before."""
    ptx = hopper_ptx(kernel_source(MMA.render(plain(), {**ADVISED, "SPLIT": split, "num_warps": warps})))
    merge = ptx.split("atom.acq_rel.gpu.global.add.s32")[1].split("bar.sync")
    # past the barrier after the arrival, up to the weights' barrier; then after it
    before, after = merge[1].count("ld.global.cg.f32"), sum(part.count("ld.global.cg.f32") for part in merge[2:])
    accumulators = 4 * 128 // (32 * warps) * split  # a thread's outputs x splits
    if in_registers:
        assert before >= accumulators and after == 0, (before, after)
    else:
        assert before < split and after >= accumulators, (before, after)  # only (m, l) before


def test_q_and_the_tables_reach_the_kernel_as_aligned_contiguous_rows(load_candidate):
    """The kernel reads q and the rotary tables 16 bytes at a time: a view whose rows are so is
    passed as it is (a GEMV's output, a table broadcast by stride 0); a strided or misaligned one
    is copied."""
    rows16 = load_candidate(MMA.render(plain(max_length=64), SMALL), "mma_rows").__dict__["_rows16"]
    q = torch.randn(2, 32, 1, 128, dtype=torch.bfloat16)
    table = torch.randn(1, 128, dtype=torch.bfloat16).expand(2, 32, 1, 128)
    for ready in (q, table, torch.randn(2, 48, 1, 128, dtype=torch.bfloat16)[:, 8:40]):
        assert rows16(ready) is ready
    wide = torch.randn(2, 32, 1, 256, dtype=torch.bfloat16)
    flat = torch.randn(2 * 32 * 128 + 1, dtype=torch.bfloat16)
    for view in (wide[..., ::2], flat[1:].view(2, 32, 1, 128)):  # strided; one element off 16 bytes
        copy = rows16(view)
        assert copy.is_contiguous() and copy.data_ptr() % 16 == 0 and torch.equal(copy, view)


def test_the_module_refuses_cpu_tensors_with_one_line(load_candidate):
    region = plain(max_length=64)
    run = load_candidate(MMA.render(region, SMALL), "mma_cpu").run
    inputs = make_fp8_inputs(region, [5])
    with pytest.raises(RuntimeError, match="NVIDIA GPU only"):
        run(*[t.cpu() for t in inputs])


# -- on the GPU --------------------------------------------------------------------------------


def run_mma(load_candidate, region, params, inputs, stem):
    module = load_candidate(MMA.render(region, params), stem)
    return module.run(*inputs)


def check_attention(out, expected):
    """bf16 output against the fp32 reference: fp16 operands for q (shifted, exact) and P."""
    assert out.shape == expected.shape and torch.isfinite(out).all()
    error = (out.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-6)
    assert error < 2e-2, float(error)


@pytest.mark.gpu
@settings(max_examples=resolve_profile().max_examples, deadline=None)  # COOPT_VERIFY_PROFILE=thorough: 200
@given(batch=st.integers(1, 3), group=st.sampled_from([1, 4, 7, 8]), form=st.sampled_from(sorted(FORMS)),
       lengths=st.lists(st.sampled_from([1, 2, 15, 16, 17, 31, 33, 255, 256, 257, 1000, 2048]), min_size=3, max_size=3),
       granularity=st.sampled_from(["per-tensor", "per-head"]), seed=st.integers(0, 2**16))
def test_it_agrees_with_an_fp32_softmax(tmp_path_factory, batch, group, form, lengths, granularity, seed):
    from coopt.runtime.kernel_loader import load_module_from_source

    region = fp8_region(batch, 2 * group, 2, 2048, 128, granularity)
    lengths = lengths[:batch]
    inputs = make_fp8_inputs(region, lengths, seed=seed)
    q = inputs[0] * 37.0  # scores far from 1: the fp16 shift must keep q exact
    expected = fp8_reference(region, q, *inputs[1:])
    module = load_module_from_source(MMA.render(region, FORMS[form]), tmp_path_factory.mktemp("mma"), "mma")
    for _ in range(2):  # the merge's counters are zero again after a launch
        (out,) = module.run(q, *inputs[1:])
        check_attention(out, expected)


@pytest.mark.gpu
def test_a_strided_or_misaligned_q_gives_the_contiguous_result(load_candidate):
    region = plain(batch=2, max_length=1024)
    inputs = make_fp8_inputs(region, [300, 17])
    module = load_candidate(MMA.render(region, ADVISED), "mma_strided")
    (expected,) = module.run(*inputs)
    q = inputs[0]
    wide = torch.zeros(*q.shape[:3], 256, dtype=q.dtype, device=q.device)
    wide[..., ::2] = q
    flat = torch.zeros(q.numel() + 1, dtype=q.dtype, device=q.device)
    flat[1:] = q.flatten()
    for view in (wide[..., ::2], flat[1:].view(q.shape)):
        (out,) = module.run(view, *inputs[1:])
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_bytes_past_the_length_never_reach_the_output(load_candidate, form):
    region = plain(batch=2, max_length=1024)
    inputs = make_fp8_inputs(region, [300, 1])
    expected = fp8_reference(region, *inputs)
    for cache in inputs[1:3]:
        cache[0, :, 300:] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
        cache[1, :, 1:] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    (out,) = run_mma(load_candidate, region, FORMS[form], inputs, "mma_nan")
    check_attention(out, expected)


def write_tables(gathered):
    """The query's and K's rotary tables: one row broadcast, or whole [512, 128] tables read at the position."""
    shape = (512, 128) if gathered else (1, 128)
    return (*rope_tables(shape, torch.bfloat16), *rope_tables(shape, torch.bfloat16, seed=2))


def fold_beside_triton(load_candidate, region, params, triton_params, inputs, stem):
    """The folded region through this family and through the Triton template from the same caches:
    the caches after the write equal byte for byte; this family's (k_cache, v_cache, out)."""
    fresh = lambda: [t.clone() if i in (1, 2) else t for i, t in enumerate(inputs)]  # noqa: E731
    k_out, v_out, out = run_mma(load_candidate, region, params, fresh(), stem)
    assert FAMILY.check(region, triton_params, H200) is None
    k_ref, v_ref, _ = load_candidate(FAMILY.render(region, triton_params), f"triton_{stem}").run(*fresh())
    assert torch.equal(k_out.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.view(torch.uint8), v_ref.view(torch.uint8))
    return k_out, v_out, out


@pytest.mark.gpu
@pytest.mark.parametrize("gathered", [False, True], ids=["broadcast tables", "gathered tables"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("write", WRITES)
def test_the_folded_write_stores_the_row_as_the_triton_template_and_attends_to_it(load_candidate, form, gathered, write):
    """The same region through the Triton template (fp16 tiles): identical caches after the write
    (both round rope(k_new) to bf16, less the offset, over the scale, to e4m3 nearest-even,
    saturating), and outputs that agree with the reference over the written caches."""
    position, lengths = WRITES[write]
    region = folded_fp8(offsets=("k", "v"), gathered=gathered)
    base = fp8_region(2, 32, 8, 512, 128, "per-head")
    q, k, v, lengths_t, k_scale, v_scale = make_fp8_inputs(base, lengths)
    cos, sin, k_cos, k_sin = write_tables(gathered)
    k_new, v_new = write_inputs(2, 8, 128, torch.bfloat16)
    k_new[0, 1, 0, 3] = 1e4 * k_scale.max()  # past e4m3's range: stored saturated
    k_offset, v_offset = (torch.randn(1, 8, 1, 128, generator=torch.Generator().manual_seed(s)).cuda() for s in (7, 8))
    inputs = [q, k, v, lengths_t, cos, sin, k_scale, v_scale, torch.tensor([position], device="cuda"), k_new, v_new,
              k_cos, k_sin, k_offset, v_offset]
    triton_params = {"BLOCK_N": 128, "SPLIT_KV": 4, "USE_DOT": True, "TILE_FP16": True, "num_warps": 4, "num_stages": 2}
    k_out, v_out, out = fold_beside_triton(load_candidate, region, FORMS[form], triton_params, inputs, "mma_folded")
    assert not torch.equal(k_out[:, :, position], k[:, :, position])  # the row was written
    assert k_out[0, 1, position, 3].float().abs() == E4M3_MAX
    row = position if gathered else slice(None)  # a whole table read at the position
    q_rope = rotated(q, cos[row], sin[row])
    expected = fp8_reference(base, q_rope, k_out, v_out, lengths_t, k_scale, v_scale)
    check_attention(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("page_size", "lengths"), [(16, [1, 17, 128]), (16, [15, 16, 100]), (64, [64, 200, 3])],
                         ids=["pages of 16", "page edges", "pages of 64"])
def test_pages_read_through_the_table(load_candidate, form, page_size, lengths):
    """Pages of three sequences shuffled in one pool with free pages; NaN past every length and
    in the free pages: only the table's pages up to each length may be read."""
    region = paged(page_size, max_pages=-(-max(lengths) // page_size) + 1)
    inputs, (k, v) = make_paged_inputs(region, lengths)
    (out,) = run_mma(load_candidate, region, FORMS[form], inputs, "mma_paged")
    check_attention(out, fp8_reference(plain(batch=3, max_length=k.shape[2]), inputs[0], k, v, inputs[3], *inputs[5:]))



# -- bf16 caches on the GPU ----------------------------------------------------------------------

BF16_FORMS = {name: {**params, "CHUNK": 16} for name, params in FORMS.items()}  # 32-key chunks: see check()
BF16_TILES = {"BLOCK_N": 64, "SPLIT_KV": 4, "USE_DOT": True, "num_warps": 4, "num_stages": 2}  # the Triton template's


@pytest.mark.gpu
@settings(max_examples=resolve_profile().max_examples, deadline=None)
@given(batch=st.integers(1, 3), group=st.sampled_from([1, 4, 7, 8]), form=st.sampled_from(sorted(BF16_FORMS)),
       lengths=st.lists(st.sampled_from([1, 2, 15, 16, 17, 31, 33, 255, 256, 257, 1000, 2048]), min_size=3, max_size=3),
       seed=st.integers(0, 2**16))
def test_bf16_caches_agree_with_an_fp32_softmax(tmp_path_factory, batch, group, form, lengths, seed):
    from coopt.runtime.kernel_loader import load_module_from_source

    region = make_region(batch, 2 * group, 2, 2048, 128, "bfloat16")
    lengths = lengths[:batch]
    q, k, v, lengths_t = make_inputs(region, lengths, seed=seed)
    q = q * 37.0  # scores far from 1
    expected = reference(region, q, k, v, lengths_t)
    module = load_module_from_source(MMA.render(region, BF16_FORMS[form]), tmp_path_factory.mktemp("mma16"), "mma16")
    for _ in range(2):  # the merge's counters are zero again after a launch
        (out,) = module.run(q, k, v, lengths_t)
        check_attention(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("form", BF16_FORMS)
def test_bf16_bytes_past_the_length_never_reach_the_output(load_candidate, form):
    region = plain_bf16(batch=2, max_length=1024)
    q, k, v, lengths = make_inputs(region, [300, 1])
    expected = reference(region, q, k, v, lengths)
    k[0, :, 300:] = v[0, :, 300:] = float("nan")
    k[1, :, 1:] = v[1, :, 1:] = float("nan")
    (out,) = run_mma(load_candidate, region, BF16_FORMS[form], [q, k, v, lengths], "mma16_nan")
    check_attention(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("gathered", [False, True], ids=["broadcast tables", "gathered tables"])
@pytest.mark.parametrize("form", BF16_FORMS)
@pytest.mark.parametrize("write", WRITES)
def test_the_bf16_folded_write_stores_the_row_as_the_triton_template(load_candidate, form, gathered, write):
    """rope(k_new) rounded to bf16 and v_new stored bit for bit as the Triton template stores
    them, and the output agreeing with the reference over the written caches."""
    position, lengths = WRITES[write]
    region = folded_bf16(gathered=gathered)
    q, k, v, lengths_t = make_inputs(plain_bf16(batch=2, max_length=512), lengths)
    cos, sin, k_cos, k_sin = write_tables(gathered)
    k_new, v_new = write_inputs(2, 8, 128, torch.bfloat16)
    inputs = [q, k, v, lengths_t, cos, sin, torch.tensor([position], device="cuda"), k_new, v_new, k_cos, k_sin]
    k_out, v_out, out = fold_beside_triton(load_candidate, region, BF16_FORMS[form], BF16_TILES, inputs, "mma16_folded")
    assert not torch.equal(k_out[:, :, position], k[:, :, position])  # the row was written
    row = position if gathered else slice(None)
    check_attention(out, reference(plain_bf16(batch=2, max_length=512), rotated(q, cos[row], sin[row]), k_out, v_out,
                                   lengths_t))


@pytest.mark.gpu
@pytest.mark.parametrize("form", BF16_FORMS)
@pytest.mark.parametrize(("page_size", "lengths"), [(16, [1, 17, 128]), (64, [64, 200, 3])],
                         ids=["pages of 16", "pages of 64"])
def test_bf16_pages_read_through_the_table(load_candidate, form, page_size, lengths):
    region = paged_bf16(page_size, max_pages=-(-max(lengths) // page_size) + 1)
    inputs, (k, v) = make_paged_inputs(region, lengths)
    (out,) = run_mma(load_candidate, region, BF16_FORMS[form], inputs, "mma16_paged")
    check_attention(out, reference(plain_bf16(batch=3, max_length=k.shape[2]), inputs[0], k, v, inputs[3]))


# -- values-only caches (K bf16, V e4m3) on the GPU ----------------------------------------------


def values_only_inputs(region, lengths, seed=0):
    """make_fp8_inputs with K drawn in bf16 (N(0, 1), like a dequantized fp8 cache's) and its scale ones, as
    fp8-kv-cache{values-only} builds them."""
    q, k, v, lengths_t, k_scale, v_scale = make_fp8_inputs(region, lengths, seed=seed)
    keys = torch.randn(k.shape, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16).to(k.device)
    return [q, keys, v, lengths_t, torch.ones_like(k_scale), v_scale]


@pytest.mark.gpu
@settings(max_examples=resolve_profile().max_examples, deadline=None)
@given(batch=st.integers(1, 3), group=st.sampled_from([1, 4, 7, 8]), form=st.sampled_from(sorted(BF16_FORMS)),
       lengths=st.lists(st.sampled_from([1, 2, 15, 16, 17, 31, 33, 255, 256, 257, 1000, 2048]), min_size=3, max_size=3),
       granularity=st.sampled_from(["per-tensor", "per-head"]), seed=st.integers(0, 2**16))
def test_values_only_caches_agree_with_an_fp32_softmax(tmp_path_factory, batch, group, form, lengths, granularity,
                                                       seed):
    from coopt.runtime.kernel_loader import load_module_from_source

    base = fp8_region(batch, 2 * group, 2, 2048, 128, granularity)
    region = values_only(base)
    inputs = values_only_inputs(base, lengths[:batch], seed=seed)
    inputs[0] = inputs[0] * 37.0  # scores far from 1
    expected = fp8_reference(region, *inputs)
    module = load_module_from_source(MMA.render(region, BF16_FORMS[form]), tmp_path_factory.mktemp("mma_vo"), "mma_vo")
    for _ in range(2):  # the merge's counters are zero again after a launch
        (out,) = module.run(*inputs)
        check_attention(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("form", BF16_FORMS)
def test_values_only_bytes_past_the_length_never_reach_the_output(load_candidate, form):
    base = plain(batch=2, max_length=1024)
    inputs = values_only_inputs(base, [300, 1])
    expected = fp8_reference(values_only(base), *inputs)
    k, v = inputs[1:3]
    k[0, :, 300:] = k[1, :, 1:] = float("nan")
    v[0, :, 300:] = v[1, :, 1:] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    (out,) = run_mma(load_candidate, values_only(base), BF16_FORMS[form], inputs, "mma_vo_nan")
    check_attention(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("gathered", [False, True], ids=["broadcast tables", "gathered tables"])
@pytest.mark.parametrize("form", BF16_FORMS)
@pytest.mark.parametrize("write", WRITES)
def test_the_values_only_folded_write_stores_the_rows_as_the_triton_template(load_candidate, form, gathered, write):
    """rope(k_new) rounded to bf16, v_new less its offset over the scale to e4m3, bit for bit as
    the Triton template stores them; the output agrees with the reference over the written caches."""
    position, lengths = WRITES[write]
    region = folded_values(gathered=gathered)
    base = fp8_region(2, 32, 8, 512, 128, "per-head")
    q, k, v, lengths_t, k_scale, v_scale = values_only_inputs(base, lengths)
    cos, sin, k_cos, k_sin = write_tables(gathered)
    k_new, v_new = write_inputs(2, 8, 128, torch.bfloat16)
    v_new[0, 1, 0, 3] = 1e4 * v_scale.max()  # past e4m3's range: stored saturated
    v_offset = torch.randn(1, 8, 1, 128, generator=torch.Generator().manual_seed(8)).cuda()
    inputs = [q, k, v, lengths_t, cos, sin, k_scale, v_scale, torch.tensor([position], device="cuda"), k_new, v_new,
              k_cos, k_sin, v_offset]
    k_out, v_out, out = fold_beside_triton(load_candidate, region, BF16_FORMS[form], BF16_TILES, inputs, "mma_vo_folded")
    assert not torch.equal(k_out[:, :, position], k[:, :, position])  # the rows were written
    assert v_out[0, 1, position, 3].float().abs() == E4M3_MAX
    row = position if gathered else slice(None)
    expected = fp8_reference(values_only(base), rotated(q, cos[row], sin[row]), k_out, v_out, lengths_t, k_scale,
                             v_scale)
    check_attention(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("form", BF16_FORMS)
@pytest.mark.parametrize(("page_size", "lengths"), [(16, [1, 17, 128]), (64, [64, 200, 3])],
                         ids=["pages of 16", "pages of 64"])
def test_values_only_pages_read_through_the_table(load_candidate, form, page_size, lengths):
    """The fp8 pool's K pages widened to bf16 (its NaN past every length and in the free pages stays NaN)."""
    region = values_only(paged(page_size, max_pages=-(-max(lengths) // page_size) + 1))
    inputs, (k, v) = make_paged_inputs(paged(page_size, max_pages=-(-max(lengths) // page_size) + 1), lengths)
    inputs[1] = inputs[1].to(torch.bfloat16)
    inputs[5] = torch.ones_like(inputs[5])
    (out,) = run_mma(load_candidate, region, BF16_FORMS[form], inputs, "mma_vo_paged")
    reference_region = values_only(plain(batch=3, max_length=k.shape[2]))
    check_attention(out, fp8_reference(reference_region, inputs[0], k.to(torch.bfloat16), v, inputs[3], *inputs[5:]))


# -- the prologue's machine code (CPU, where nvcc is installed) ----------------------------------

PROLOGUE_REGIONS = ["plain per-head", "bf16 plain", "folded, smooth-k", "bf16 folded, gathered tables",
                    "values-only plain", "values-only folded, gathered tables, smooth-v"]


@pytest.mark.parametrize("region", PROLOGUE_REGIONS)
def test_the_ring_fills_before_q_is_rotated_and_before_the_new_row_is_written(hopper_sass, region):
    """The first cp.async goes out within ~300 instructions of the kernel's start, before any
    tensor-core op and any store of the folded row: ptxas used to hoist q's unpacking, rope and
    packing above the copies (407 instructions before the first one in the bare bf16 form, 816
    folded), and the folded row was stored behind a block barrier before them (session 34's
    device call: b1 / 2048 bf16 folded 7.57 µs against 8.45)."""
    bf16_keys = REGIONS[region].inputs[1].dtype == "bfloat16"
    sass = hopper_sass(kernel_source(MMA.render(REGIONS[region], BF16_FORMS["advised"] if bf16_keys else ADVISED)))
    first_copy = next(i for i, op in enumerate(sass) if op.startswith("LDGSTS"))
    first_store = next((i for i, op in enumerate(sass) if op.startswith("STG")), len(sass))
    assert first_copy < 300 and first_copy < first_store, (first_copy, first_store)
    assert first_copy < next(i for i, op in enumerate(sass) if op.startswith("HMMA"))


def test_a_full_chunk_copies_its_rows_from_per_lane_addresses(hopper_sass):
    """A chunk every row of which lies below the length (all but a split's last) is copied with
    no zero-fill operand, each copy's addresses a base and a constant: the bare bf16 form's ring
    fill takes under 100 instructions for its 16 copies of a chunk (the general loop ~200)."""
    sass = hopper_sass(kernel_source(MMA.render(REGIONS["bf16 plain"], BF16_FORMS["advised"])))
    copies = [i for i, op in enumerate(sass) if op.startswith("LDGSTS")]
    first_chunk = copies[:16]
    assert all(", !P" not in sass[i] for i in first_chunk)  # no ignore-src predicate: every row valid
    assert first_chunk[-1] - first_chunk[0] < 100, first_chunk
