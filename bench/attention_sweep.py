"""Decode attention on the GPU: the advisor's first points against a sample of the whole space,
and whether prefetching the next GEMV's weights into L2 while the attention runs pays.

    python bench/attention_sweep.py                       # the four cases below, 8 advised + 32 sampled points
    python bench/attention_sweep.py --cases b1-2048 --sample 0 --advised 4
    python bench/attention_sweep.py --prefetch-only       # only the L2 prefetch experiment
    python bench/attention_sweep.py --list                # the points, no GPU needed
    python bench/attention_sweep.py --latency b1-2048-rope  # fixed cost vs streaming of the first points

Cases (Llama-3-8B attention: 32 query heads over 8 kv heads, D 128, bf16 query; `length` valid
keys of a `cache`-position static cache): b1-2048, b1-2048-rope (the query's rotary embedding in
the kernel, as a Llama decode step builds it), b32-2048, b1-32768, b1-32768-fp8, b32-2048-fp8 and
b32-8192-fp8 (the cache in float8_e4m3fn with per-head scales, where TILE_FP16 applies; b1-2048-fp8 and the
b32 fp8 cases only when named), and b32-2048-paged16 (the caches in
a shuffled pool of 16-position pages read through a page table, as a --paged-kv 16 build reads
them; its sample also holds the advisor's first points with one page or less a tile, what builds
chose before tiles could cover several pages). Each point is rendered by the
family, checked against an fp32 softmax over the valid keys, and timed replayed in a CUDA graph
(triton.testing.do_bench_cudagraph) over copies of the caches that together exceed the L2, as a
decode step runs: its bandwidth is the valid K/V bytes (`kv_bytes_read`) over the time.

Prefetch (`--prefetch`, on by default): at batch 1 and length 2048 the attention is
latency-bound (13 µs for 8.4 MB in session 5's profile) while the o-projection GEMV after it
streams 33.5 MB of weights at ~3 TB/s. The experiment replays 8 layers of (attention, o GEMV +
residual) in one CUDA graph, the o GEMV on its own weights per layer, three ways: one after the
other; with a second stream that prefetches the layer's o weights into L2 (prefetch.global.L2)
while its attention runs; and the prefetch alone; then (session 38) a quarter, half or all of
each layer's o weights pulled into L2 by cp.async.bulk.prefetch.L2 (the TMA unit: one
instruction per chunk of up to 1 MB) from a small kernel launched on the same stream just before
the attention; then (session 39, after the H100 found "bulk" no faster: its one or two programs
may be held to one SM's TMA rate) "spread", the same prefetch from one program an SM, one chunk
each, and "spread 0", 16 bytes a program: the launch's own cost. The GEMV point and the attention
point are the advisor's first.

Latency (`--latency CASE`): at batch 1 the attention reads 8.4 MB in ~10 µs (a floor of 2), and
no point of its space is faster (session 6). Which part is fixed cost and which is streaming?
The advisor's first points are timed at valid lengths from 1 to the whole cache, each length
over the same rotation of cache copies (5 GB of them: DRAM-resident from 128 keys on at a
4096-position cache), beside an empty one-program Triton kernel (what a launch costs inside a
graph). A least-squares line through
the lengths of 512 keys and more gives the fixed cost (its intercept) and the streaming
bandwidth (its slope); the intercept less the empty launch is what the kernel's own latencies
(the length load, q and its rotary rows, the first tiles, the splits' meeting) add.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bandwidth import reference_bandwidth  # noqa: E402
from gemm import announce_gpu, graph_ms, input_copies, print_points  # noqa: E402  (shared with the GEMM bench)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# name -> (batch, valid length, cache positions, fp8 cache[, the query's rope in the kernel[, page size]])
CASES = {
    "b1-2048": (1, 2048, 4096, False),
    "b1-2048-rope": (1, 2048, 4096, False, True),  # as a Llama decode step builds it (fuse-attention)
    "b32-2048": (32, 2048, 4096, False),
    "b1-32768": (1, 32768, 32832, False),
    "b1-32768-fp8": (1, 32768, 32832, True),
    "b1-2048-fp8": (1, 2048, 4096, True),  # bench/fold_kernel_times.py's short fp8 case
    "b32-2048-fp8": (32, 2048, 4096, True),  # issue 4's batched fp8 cases
    "b32-8192-fp8": (32, 8192, 8256, True),
    "b32-2048-paged16": (32, 2048, 4096, False, False, 16),  # bench/capacity.py's pages
}
DEFAULT_CASES = [name for name in CASES if name not in ("b1-2048-fp8", "b32-2048-fp8", "b32-8192-fp8")]  # the `sweep` step's
ROPE_TABLE = (1, HEAD_DIM)  # cos / sin at the step's position, broadcast over batch and heads


def make_region(batch: int, length: int, cache: int, fp8: bool, rope: bool = False, page: int | None = None):
    from coopt.ir.region import RegionSummary, TensorSpec

    q = TensorSpec((batch, HEADS, 1, HEAD_DIM), "bfloat16")
    kv_dtype = "float8_e4m3fn" if fp8 else "bfloat16"
    attrs = {"scale": HEAD_DIM ** -0.5, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "lengths_input": 3,
             "lengths_bound": [1, 2], "example_length": length}
    if page:  # a pool of every sequence's pages plus one, and a table of cache / page pages a sequence
        pool = TensorSpec((batch * cache // page + 1, KV_HEADS, page, HEAD_DIM), kv_dtype)
        inputs = [q, pool, pool, TensorSpec((batch,), "int32"), TensorSpec((batch, cache // page), "int32")]
        attrs["page_size"] = page
    else:
        kv = TensorSpec((batch, KV_HEADS, cache, HEAD_DIM), kv_dtype)
        inputs = [q, kv, kv, TensorSpec((batch,), "int32")]
    if rope:  # cos, sin follow the lengths (before any scales)
        inputs += [TensorSpec(ROPE_TABLE, "bfloat16")] * 2
        attrs["rope"] = True
    if fp8:
        inputs += [TensorSpec((KV_HEADS,), "float32")] * 2
        attrs["kv_scale"] = "per-head"
    name = (f"decode_attention_b{batch}_{length}" + ("_fp8" if fp8 else "") + ("_rope" if rope else "")
            + (f"_paged{page}" if page else ""))
    return RegionSummary(name, "decode_attention", inputs=tuple(inputs), outputs=(q,), attrs=attrs)


def make_inputs(region, length: int, seed: int = 0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch = region.inputs[0].shape[0]
    q = torch.randn((batch, 1, HEADS, HEAD_DIM), generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
    page = region.attrs.get("page_size")
    if page:
        pool_shape = region.inputs[1].shape
        k, v = (torch.randn(pool_shape, generator=gen, device="cuda").to(torch.bfloat16) for _ in "kv")
        # every sequence's pages drawn from the whole pool in shuffled order (page 0 left free)
        order = torch.randperm(pool_shape[0] - 1, generator=gen, device="cuda") + 1
        table = order.view(batch, -1).to(torch.int32)
        return [q, k, v, torch.full((batch,), length, dtype=torch.int32, device="cuda"), table]
    cache_shape = region.inputs[1].shape
    k, v = (torch.randn(cache_shape, generator=gen, device="cuda") for _ in "kv")
    inputs = [q, k, v, torch.full((batch,), length, dtype=torch.int32, device="cuda")]
    if region.attrs.get("rope"):
        angles = torch.rand(ROPE_TABLE, generator=gen, device="cuda") * 6.283
        inputs += [angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)]
    if region.attrs.get("kv_scale"):
        scales = [t.abs().amax(dim=(0, 2, 3)) / 448 for t in (k, v)]
        inputs[1], inputs[2] = ((t / s[None, :, None, None]).to(torch.float8_e4m3fn) for t, s in zip((k, v), scales))
        inputs += scales
    else:
        inputs[1], inputs[2] = k.to(torch.bfloat16), v.to(torch.bfloat16)
    return inputs


def reference(region, q, k, v, lengths, *rest):
    """fp32 softmax over each sequence's valid keys, kv heads repeated for the group (the query
    rotated first when the region has its rope; k, v times their per-head scales when fp8)."""
    import torch

    if region.attrs.get("page_size"):  # each sequence's cache gathered from its pages: [B, Hkv, S, D]
        table, *rest = rest
        k, v = (t[table.long()].permute(0, 2, 1, 3, 4).flatten(2, 3) for t in (k, v))
    if region.attrs.get("rope"):
        cos, sin, *rest = rest
        half = q.shape[-1] // 2
        rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
        q = (q.float() * cos.float() + rotated.float() * sin.float()).to(q.dtype)
    k_scale, v_scale = rest if rest else (None, None)
    group = HEADS // KV_HEADS
    k, v = k.float(), v.float()
    if k_scale is not None:
        k, v = k * k_scale[None, :, None, None], v * v_scale[None, :, None, None]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(lengths.tolist()):
        keys, values = (t[b, :, :length].repeat_interleave(group, dim=0) for t in (k, v))
        scores = q[b].float() @ keys.transpose(-1, -2) * region.attrs["scale"]
        out[b] = torch.softmax(scores, dim=-1) @ values
    return out


def advised(region, family) -> list[dict]:
    """Every legal point, the heuristic advisor's ranking."""
    from coopt.llm_advisor import AdviceRequest, HeuristicAdvisor
    from coopt.targets import H200

    legal = family.legal_points(region, H200)
    request = AdviceRequest(region, family.name, family.param_space(region, H200), tuple(legal), H200.facts())
    return list(HeuristicAdvisor().advise(request).ranked)


def select_points(region, family, args) -> list[dict]:
    from coopt.targets import H200

    ranked = advised(region, family)
    first = ranked[:args.advised]
    page = region.attrs.get("page_size")
    # paged: the advisor's first points among tiles of one page or less (what builds chose
    # before a tile could cover pages) join the sample
    within_page = [p for p in ranked if page and p["BLOCK_N"] <= page and p not in first][:2]
    rest = [p for p in family.legal_points(region, H200) if p not in first and p not in within_page]
    return first + within_page + random.Random(0).sample(rest, min(args.sample, len(rest)))


def label(params: dict) -> str:
    text = (f"n{params['BLOCK_N']} split{params['SPLIT_KV']} {'dot' if params['USE_DOT'] else 'fma'} "
            f"w{params['num_warps']} s{params['num_stages']}")
    return text + (" fp16-tiles" if params.get("TILE_FP16") else "") + (" v-words" if params.get("V_WORDS") else "")


def _warm(job) -> str | None:
    """Worker process: compile one point by running it once (fills the shared Triton cache)."""
    path, case = job
    try:
        import torch

        from coopt.runtime.kernel_loader import load_module_from_file

        load_module_from_file(path).run(*make_inputs(make_region(*CASES[case]), CASES[case][1]))
        torch.cuda.synchronize()
        return None
    except Exception as error:
        return f"{type(error).__name__}: {str(error)[:200]}"


def sweep(args, work_dir: Path, rows: list) -> None:
    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.decode_attention import DecodeAttentionFamily, kv_bytes_read

    family = DecodeAttentionFamily()
    plan = []
    for case in args.cases:
        region = make_region(*CASES[case])
        for i, params in enumerate(select_points(region, family, args)):
            path = work_dir / f"{case}__{i}.py"
            path.write_text(family.render(region, params))
            plan.append((case, i, params, str(path)))
    started = time.time()
    print(f"compiling {len(plan)} kernels in {args.jobs} processes ...", flush=True)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        warm_errors = list(pool.map(_warm, [(path, case) for case, _, _, path in plan]))
    print(f"compiled in {time.time() - started:.0f} s", flush=True)
    for case in args.cases:
        batch, length = CASES[case][:2]
        region = make_region(*CASES[case])
        inputs = make_inputs(region, length)
        expected = reference(region, *inputs)
        traffic = kv_bytes_read(region, [length] * batch)
        input_sets = input_copies(inputs, traffic)  # the valid K/V of the copies past the L2
        print(f"\n{case}: {traffic / 1e6:.1f} MB of valid K/V, floor {traffic / reference_bandwidth() * 1e6:.1f} us "
              f"at {reference_bandwidth() / 1e12:.2f} TB/s; graphs rotate {len(input_sets)} input copies", flush=True)
        results = []
        for (c, rank, params, path), warm_error in zip(plan, warm_errors):
            if c != case:
                continue
            try:
                run = load_module_from_file(path).run
                err = (run(*inputs)[0].float() - expected).abs().max().item()
                if not err < 3e-2:
                    print(f"  {label(params):40s} WRONG: max abs err {err:.2e}", flush=True)
                    continue
                ms = graph_ms(run, input_sets, rep=30)
            except Exception as error:
                print(f"  {label(params):40s} FAILED: {warm_error or f'{type(error).__name__}: {str(error)[:200]}'}",
                      flush=True)
                continue
            results.append((ms, rank, params, err))
        for ms, rank, params, err in sorted(results, key=lambda r: r[0]):
            page = region.attrs.get("page_size")
            tag = (f"advised #{rank + 1}" if rank < args.advised
                   else "1-page tile" if page and params["BLOCK_N"] <= page and rank < args.advised + 2 else "sampled")
            print(f"  {label(params):40s} {ms * 1e3:7.1f} us {traffic / ms / 1e9:6.2f} TB/s  {tag:11s} err {err:.1e}",
                  flush=True)
            rows.append({"case": case, "params": params, "advised_rank": rank + 1 if rank < args.advised else None,
                         "us": ms * 1e3, "tb_per_s": traffic / ms / 1e9, "err": err})


@triton.jit
def _prefetch_l2_kernel(ptr, numel, BLOCK: tl.constexpr, STRIDE: tl.constexpr):
    # one prefetch.global.L2 per STRIDE elements (a 64-byte run of bf16 at 32)
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)) * STRIDE
    ptrs = ptr + tl.minimum(offs, numel - 1)
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _bulk_prefetch_l2_kernel(ptr, CHUNK_ELEMENTS: tl.constexpr, CHUNK_BYTES: tl.constexpr, LANES: tl.constexpr):
    # one cp.async.bulk.prefetch.L2 (sm_90: the TMA unit fetches CHUNK_BYTES into L2, fire and
    # forget) per lane: a few instructions for the whole weight, where prefetch.global.L2 took
    # one per 64 bytes (session 6: the prefetch alone then "took" 4.8 µs a layer)
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    ptrs = ptr + lane.to(tl.int64) * CHUNK_ELEMENTS
    size = tl.full([LANES], CHUNK_BYTES, tl.int32)
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tcp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r", [ptrs, size],
                              dtype=tl.int32, is_pure=False, pack=1)


def bulk_prefetch_chunks(total_bytes: int, share: float, lanes: int = 32, chunk_max: int = 1 << 20) -> tuple[int, int]:
    """(programs, chunk bytes) for a bulk prefetch of the first `share` of `total_bytes`: chunks
    of at most `chunk_max` bytes, a multiple of 16 (the instruction's unit), `lanes` a program;
    the last partial chunk is left out, so nothing past the tensor is touched."""
    wanted = int(total_bytes * share)
    programs = max(1, -(-wanted // (lanes * chunk_max)))
    chunk = wanted // (programs * lanes) // 16 * 16
    return programs, chunk


def prefetch_experiment(work_dir: Path, rows: list, layers: int = 8) -> None:
    """8 layers of (attention, o GEMV + residual) in one graph, with and without an L2 prefetch
    of each layer's o weights on a second stream during its attention; then (session 38) a bulk
    prefetch of half or all of them launched on the same stream just before the attention."""
    import torch
    from triton.testing import do_bench_cudagraph

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.decode_attention import DecodeAttentionFamily
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily
    from gemm import advised_points
    from gemm import make_inputs as gemm_inputs
    from gemm import make_region as gemm_region

    def prefetch(weight):
        numel, per = weight.numel(), 1024 * 32
        _prefetch_l2_kernel[(triton.cdiv(numel, per),)](weight, numel, BLOCK=1024, STRIDE=32, num_warps=4)

    attention_family, gemv_family = DecodeAttentionFamily(), MatmulEpilogueFamily()
    batch, length, cache, _ = CASES["b1-2048"]
    attn_region = make_region(batch, length, cache, False)
    attn_params = advised(attn_region, attention_family)[0]
    o_region = gemm_region(1, 4096, 4096, "residual")
    o_params = advised_points(o_region, 1)[0]
    (work_dir / "attn.py").write_text(attention_family.render(attn_region, attn_params))
    (work_dir / "o.py").write_text(gemv_family.render(o_region, o_params))
    attention = load_module_from_file(str(work_dir / "attn.py")).run
    o_gemv = load_module_from_file(str(work_dir / "o.py")).run
    attn_inputs = [make_inputs(attn_region, length, seed=i) for i in range(layers)]
    o_inputs = [gemm_inputs(o_region, seed=i) for i in range(layers)]
    side = torch.cuda.Stream()

    def bulk(weight, share: float):
        programs, chunk = bulk_prefetch_chunks(weight.numel() * weight.element_size(), share)
        _bulk_prefetch_l2_kernel[(programs,)](weight, CHUNK_ELEMENTS=chunk // weight.element_size(),
                                              CHUNK_BYTES=chunk, LANES=32, num_warps=1)

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def spread(weight, share: float):
        # session 39: one program an SM, one bulk prefetch each (a single SM's TMA unit may not
        # pull more than a small share of the DRAM's rate; "bulk" used 1-2 programs). Share 0:
        # 16 bytes a program, the prefetch launch's own cost.
        chunk = max(16, int(weight.numel() * weight.element_size() * share) // sms // 16 * 16)
        _bulk_prefetch_l2_kernel[(sms,)](weight, CHUNK_ELEMENTS=chunk // weight.element_size(),
                                         CHUNK_BYTES=chunk, LANES=1, num_warps=1)

    def step(mode: str):
        for a, o in zip(attn_inputs, o_inputs):
            if mode.startswith("bulk"):  # "bulk 0.5": that share of the o weights, same stream
                bulk(o[1], float(mode.split()[1]))
            if mode.startswith("spread"):  # "spread 0.5": the same, over one program an SM
                spread(o[1], float(mode.split()[1]))
            if mode in ("prefetch", "prefetch only"):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    prefetch(o[1])
            if mode != "prefetch only":
                out = attention(*a)[0]
            if mode in ("prefetch", "prefetch only"):
                # only a side stream that joined the capture may be waited on (else the capture fails)
                torch.cuda.current_stream().wait_stream(side)
            if mode != "prefetch only":
                o[0].copy_(out.view(1, -1))  # the attention's output is the o projection's input
                o_gemv(*o)

    modes = ("sequential", "prefetch", "prefetch only", "bulk 0.25", "bulk 0.5", "bulk 1.0", "spread 0",
             "spread 0.25", "spread 0.5", "spread 1.0", "sequential")
    for mode in modes[:-1]:
        step(mode)  # compiled and warm before capture
    torch.cuda.synchronize()
    print(f"\nL2 prefetch of the o weights during the attention ({layers} layers, b1 length 2048; "
          f"attention {label(attn_params)}, o GEMV advised first):", flush=True)
    for mode in modes:
        ms = do_bench_cudagraph(lambda: step(mode), rep=100, return_mode="median")
        print(f"  {mode:14s} {ms * 1e3:8.1f} us a step ({ms * 1e3 / layers:.1f} us a layer)", flush=True)
        rows.append({"experiment": "l2-prefetch", "mode": mode, "layers": layers, "us": ms * 1e3})


LATENCY_LENGTHS = (1, 128, 512, 1024, 2048, 4096)
LATENCY_BYTES = 5e9  # the rotation's cache copies: 300 at b1 / 4096 positions, DRAM-resident from 128 keys on


def fit_latency(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept us, bandwidth TB/s) of the least-squares line us = a + bytes / bw through
    (bytes, us) points; NaN bandwidth when the slope is not positive."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var  # us per byte
    return mean_y - slope * mean_x, (1e-6 / slope if slope > 0 else float("nan"))  # 1 / slope bytes a us = 1e-6 / slope TB/s


@triton.jit
def _empty_kernel(ptr):
    tl.store(ptr + tl.program_id(0), 0)


def latency_experiment(args, work_dir: Path, rows: list) -> None:
    """The advisor's first `--advised` points (at most 3) of one case at growing valid lengths,
    and an empty launch: fixed cost against streaming."""
    import torch

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.decode_attention import DecodeAttentionFamily, kv_bytes_read

    case = args.latency
    batch, _, cache = CASES[case][:3]
    family = DecodeAttentionFamily()
    region = make_region(*CASES[case])
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    empty_us = graph_ms(lambda: _empty_kernel[(1,)](flag), [[]], rep=30) * 1e3
    print(f"\nlatency of {case} (cache {cache}): an empty launch in a graph {empty_us:.2f} us", flush=True)
    rows.append({"experiment": "latency", "case": case, "empty_launch_us": empty_us})
    base = make_inputs(region, cache)
    cache_bytes = sum(t.numel() * t.element_size() for t in base[1:3])
    count = max(8, min(300, int(LATENCY_BYTES // cache_bytes)))
    copies = [base] + [[t.clone() for t in base] for _ in range(count - 1)]
    lengths = [n for n in LATENCY_LENGTHS if n <= cache] + ([cache] if cache not in LATENCY_LENGTHS else [])
    for rank, params in enumerate(advised(region, family)[:min(args.advised, 3)]):
        path = work_dir / f"latency_{case}_{rank}.py"
        path.write_text(family.render(region, params))
        run = load_module_from_file(str(path)).run
        points = []
        for length in lengths:
            for inputs in copies:  # the length is data: the same kernel, fewer keys
                inputs[3].fill_(length)
            expected = reference(region, *copies[0])
            err = (run(*copies[0])[0].float() - expected).abs().max().item()
            us = graph_ms(run, copies, rep=30) * 1e3
            points.append((kv_bytes_read(region, [length] * batch), us))
            print(f"  #{rank + 1} {label(params):36s} length {length:6d}: {us:7.2f} us  err {err:.1e}", flush=True)
        intercept, bandwidth = fit_latency([p for p, n in zip(points, lengths) if n >= 512])
        print(f"  #{rank + 1} fixed {intercept:.2f} us ({intercept - empty_us:.2f} over an empty launch), "
              f"streaming at {bandwidth:.2f} TB/s", flush=True)
        rows.append({"experiment": "latency", "case": case, "params": params, "advised_rank": rank + 1,
                     "points": [{"length": n, "bytes": b, "us": us} for n, (b, us) in zip(lengths, points)],
                     "fixed_us": intercept, "tb_per_s": bandwidth})


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma list of: " + ",".join(CASES))
    parser.add_argument("--advised", type=int, default=8, help="the heuristic advisor's first N points per case")
    parser.add_argument("--sample", type=int, default=32, help="a seeded random sample of this many other legal points")
    parser.add_argument("--prefetch-only", action="store_true", help="only the L2 prefetch experiment")
    parser.add_argument("--no-prefetch", action="store_true", help="skip the L2 prefetch experiment")
    parser.add_argument("--jobs", type=int, default=16, help="parallel compile processes")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument("--list", action="store_true", help="print the points per case and exit (no GPU needed)")
    parser.add_argument("--latency", default=None, metavar="CASE",
                        help="only the latency experiment on CASE (unpaged, bf16 or fp8): fixed cost against streaming")
    args = parser.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    if args.latency is not None and (args.latency not in CASES or len(CASES[args.latency]) > 5):
        parser.error(f"--latency takes an unpaged case: {', '.join(c for c in CASES if len(CASES[c]) <= 5)}")
    return args


def main() -> int:
    args = parse_args()
    if args.list:
        from coopt.templates.decode_attention import DecodeAttentionFamily

        family = DecodeAttentionFamily()
        print_points({case: select_points(make_region(*CASES[case]), family, args) for case in args.cases}, label)
        return 0
    if not announce_gpu("bench/attention_sweep.py"):
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="coopt_attention_"))
    rows: list = []
    try:
        if args.latency is not None:
            latency_experiment(args, work_dir, rows)
            return 0
        if not args.prefetch_only:
            sweep(args, work_dir, rows)
        if not args.no_prefetch:
            prefetch_experiment(work_dir, rows)
    finally:
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
