"""Does the fp8 decode attention stream faster when the V cache holds each head's keys
contiguously ([B, Hkv, D, S] storage, read through a [B, Hkv, S, D] view)?

Why it might: P @ V reduces over the keys. In the usual [.., S, D] layout an fp8 V tile reaches
tl.dot's operand one byte a shared-memory load (its operand runs along the keys, D bytes apart:
docs/kv-cache.md counts 128 LDS.U8 a thread a 128-key tile), and the fp8 attention streams at
~2.5 TB/s against bf16's ~3.4-4.3 (bench/RESULTS.md sessions 16-21). With keys contiguous the
operand loads 4 keys a 32-bit load, as K's already does along D. The kernel is the same template:
Triton specializes a stride of 1, so the keys-contiguous view alone changes its loads.

    python bench/v_layout_probe.py                          # the cases below, every point both ways
    python bench/v_layout_probe.py --cases b1-32768-fp8 --json /tmp/v.json
    python bench/v_layout_probe.py --cases b1-32768-fp8 --layouts rows --warps 4 --stages 2,3,4,5,6
    python bench/v_layout_probe.py --cases b1-32768-fp8 --layouts rows --warps 4 --stages 3 --splits 32,40,48

The second form asks another question of the same kernel (session 22's sweep: 3 stages beat 2
by 10-40 % at every fp8 point, the space stops at 4): do deeper pipelines of smaller tiles help?
Stages past the space's 4 are rendered as they are; a point is kept where the family accepts it at
min(stages, 4) and its K/V stages fit the shared memory. The third form: split counts that are no
power of two (outside the space; the template renders them) to fill each SM with as many programs
as its shared memory holds (split 32 gives b1 / 32768 two programs an SM, 64 more than one wave).

Each point is rendered by DecodeAttentionFamily, checked against attention_sweep's fp32
reference, and timed replayed in CUDA graphs over copies of the caches past the L2 (as
attention_sweep does), V row-major and V keys-contiguous, same values.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attention_sweep import CASES, HEAD_DIM, label, make_inputs, make_region, reference  # noqa: E402
from gemm import announce_gpu, graph_ms, input_copies  # noqa: E402

# case -> SPLIT_KV values timed (BLOCK_N 64 / 128, 4 / 8 warps, 2 / 3 stages, tl.dot; fp8: fp16 tiles)
SPLITS = {"b1-32768-fp8": (16, 32, 64), "b1-2048-fp8": (8, 16), "b32-2048-fp8": (1, 2), "b32-8192-fp8": (1, 2),
          "b1-32768": (16, 32)}
LAYOUTS = ("rows", "keys")  # V [.., S, D] as stored today; V with each head's keys contiguous


def keys_contiguous(v):
    """The same values, stored [B, Hkv, D, S] and viewed [B, Hkv, S, D] (stride 1 along S)."""
    return v.transpose(2, 3).contiguous().transpose(2, 3)


def case_inputs(case: str, layout: str):
    region = make_region(*CASES[case])
    inputs = make_inputs(region, CASES[case][1])
    if layout == "keys":
        inputs[2] = keys_contiguous(inputs[2])
    return region, inputs


def points(case: str, warps=(4, 8), stages=(2, 3), splits=None) -> list[dict]:
    from coopt.targets import H200
    from coopt.templates.decode_attention import DecodeAttentionFamily
    from coopt.templates.attention import kv_element_bytes

    family, region = DecodeAttentionFamily(), make_region(*CASES[case])
    fp8 = region.attrs.get("kv_scale") is not None
    legal = []
    cache = region.inputs[1].shape[2]
    for bn, split, w, depth in itertools.product((64, 128), splits or SPLITS[case], warps, stages):
        params = {"BLOCK_N": bn, "SPLIT_KV": split, "USE_DOT": True, "num_warps": w, "num_stages": depth,
                  **({"TILE_FP16": True} if fp8 else {})}
        # the family's own rules at the space's deepest pipeline and its largest split at or below
        # this one, then the K/V stages' shared memory and the splits' tiles in the cache
        stage_bytes = 2 * bn * HEAD_DIM * kv_element_bytes(region)
        nearest = max(v for v in family.param_space(region, H200)["SPLIT_KV"] if v <= split)
        in_space = {**params, "num_stages": min(depth, 4), "SPLIT_KV": nearest}
        if (family.check(region, in_space, H200) is None and depth * stage_bytes <= H200.smem_per_block_bytes - 8192
                and split * bn <= cache):
            legal.append(params)
    return legal


def _warm(job) -> str | None:
    """Worker process: compile one (point, layout) by running it once (Triton specializes the
    stride of 1, so each layout is its own compile)."""
    path, case, layout = job
    try:
        import torch

        from coopt.runtime.kernel_loader import load_module_from_file

        load_module_from_file(path).run(*case_inputs(case, layout)[1])
        torch.cuda.synchronize()
        return None
    except Exception as error:
        return f"{type(error).__name__}: {str(error)[:200]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(SPLITS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="V layouts timed: rows, keys")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3", help="pipeline depths (past the space's 4 where they fit)")
    parser.add_argument("--splits", default=None,
                        help="SPLIT_KV values for every case (default: SPLITS' per case; values that are no power "
                             "of two, outside the space, render too: more programs an SM than the next lower power)")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cases, layouts = args.cases.split(","), args.layouts.split(",")
    warps, stages = tuple(map(int, args.warps.split(","))), tuple(map(int, args.stages.split(",")))
    splits = tuple(map(int, args.splits.split(","))) if args.splits else None
    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.decode_attention import DecodeAttentionFamily, kv_bytes_read

    if not announce_gpu("bench/v_layout_probe.py"):
        return 1
    family = DecodeAttentionFamily()
    work = Path("/tmp/v-layout-probe")
    work.mkdir(exist_ok=True)
    plan = []
    for case in cases:
        region = make_region(*CASES[case])
        for i, params in enumerate(points(case, warps, stages, splits)):
            path = work / f"{case}__{i}.py"
            path.write_text(family.render(region, params))
            plan += [(case, params, str(path), layout) for layout in layouts]
    started = time.time()
    print(f"compiling {len(plan)} kernels in {args.jobs} processes ...", flush=True)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        errors = list(pool.map(_warm, [(path, case, layout) for case, _, path, layout in plan]))
    print(f"compiled in {time.time() - started:.0f} s", flush=True)
    rows, best = [], {}
    for case in cases:
        batch, length = CASES[case][:2]
        region = make_region(*CASES[case])
        traffic = kv_bytes_read(region, [length] * batch)
        print(f"\n{case}: {traffic / 1e6:.1f} MB of valid K/V", flush=True)
        for layout in layouts:
            _, inputs = case_inputs(case, layout)
            expected = reference(region, *inputs)
            sets = input_copies(inputs, traffic)
            for (c, params, path, lay), error in zip(plan, errors):
                if (c, lay) != (case, layout):
                    continue
                try:
                    run = load_module_from_file(path).run
                    err = (run(*inputs)[0].float() - expected).abs().max().item()
                    ms = graph_ms(run, sets, rep=30) if err < 3e-2 else float("nan")
                except Exception as exc:
                    print(f"  {layout:4s} {label(params):36s} FAILED: {error or str(exc)[:200]}", flush=True)
                    continue
                row = {"case": case, "layout": layout, "params": params, "us": ms * 1e3,
                       "tb_per_s": traffic / ms / 1e9, "err": err}
                rows.append(row)
                print(f"  {layout:4s} {label(params):36s} {row['us']:7.2f} us {row['tb_per_s']:5.2f} TB/s err {err:.1e}",
                      flush=True)
                if err < 3e-2 and row["us"] < best.get((case, layout), {"us": float("inf")})["us"]:
                    best[(case, layout)] = row
            del sets
    print("\nbest point per case and V layout:")
    for case in cases:
        for layout in layouts:
            row = best.get((case, layout))
            if row:
                print(f"  {case:14s} {layout:4s} {row['us']:7.2f} us {row['tb_per_s']:5.2f} TB/s  {label(row['params'])}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
