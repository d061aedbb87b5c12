"""The decode attention with the step's cache write folded in, timed alone against the two
kernels it replaces (kv_write, then the attention) at the same points of the space: is a folded
launch slower than the plain attention by more than the kv_write launch it saves?

Session 16: an fp8 b1 / 32768 build measured 1.413 ms with the write folded against 1.409
without (and 1.461 / 1.453 in a second pair of builds), while the profile of those builds at
position 2048 showed the fold 15 µs a step faster. Builds also differ in the points their
measurement selects; this times fixed points side by side.

    python bench/fold_kernel_times.py --cases b1-32768-fp8,b1-2048-fp8,b1-2048-rope --splits 16,32

fp8 cases time each point twice: V's tiles loaded as bytes and as 16-bit words (V_WORDS). Every
case the CUDA family (templates/decode_attention_mma.py) takes (fp8 with per-head scales, and
bf16 since session 32) times each --mma point it admits without the query's rope, with it, and
with the write folded in: what each costs that kernel against the template.

Each case is attention_sweep's (Llama-3-8B heads, the query's rope in the kernel; fp8: per-head
scales), the new row at the last valid position, K rotated by the query's tables as a Llama
step does; kv_write runs at the heuristic advisor's first point. Timed replayed in CUDA graphs
over copies of the caches past the L2 (gemm.graph_ms).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attention_sweep import CASES, HEAD_DIM, KV_HEADS, advised, make_inputs, make_region  # noqa: E402
from gemm import announce_gpu, graph_ms, input_copies  # noqa: E402

from coopt.targets import H200  # noqa: E402


def write_region(attention):
    """The unfolded step's kv_write: K rotated by the query's tables, quantized per head when fp8."""
    from coopt.ir.region import RegionSummary, TensorSpec

    q, k_cache, v_cache = attention.inputs[:3]
    new = TensorSpec((q.shape[0], KV_HEADS, 1, HEAD_DIM), q.dtype)
    fp8 = attention.attrs.get("kv_scale") is not None
    scales = attention.inputs[6:8] if fp8 else ()
    return RegionSummary("kv_write", "kv_write", inputs=(k_cache, v_cache, TensorSpec((1,), "int64"), new, new,
                                                        *attention.inputs[4:6], *scales),
                         outputs=(k_cache, v_cache),
                         attrs={"rope": True, "quant": "per-head" if fp8 else "none", "inplace": [0, 1]})


def folded_region(attention):
    """The attention with that write folded in (fuse-kv-write-attention's form, shared tables)."""
    from coopt.ir.region import TensorSpec

    q = attention.inputs[0]
    new = TensorSpec((q.shape[0], KV_HEADS, 1, HEAD_DIM), q.dtype)
    at = len(attention.inputs)
    return dataclasses.replace(
        attention, inputs=(*attention.inputs, TensorSpec((1,), "int64"), new, new),
        outputs=(attention.inputs[1], attention.inputs[2], q),
        attrs={**attention.attrs, "kv_write": {"positions_input": at, "rope": True, "rope_tables_input": 4},
               "inplace": [1, 2]})


def without_rope(attention):
    """The attention region less the query's rope (its inputs less cos and sin): the bare form."""
    return dataclasses.replace(attention, inputs=(*attention.inputs[:4], *attention.inputs[6:]),
                               attrs={k: v for k, v in attention.attrs.items() if k != "rope"})


LOOP_BODY_START = "    const unsigned char* k_slot = slot(i);\n"
LOOP_BODY_END = "    __syncwarp();  // every lane is done with the slot: refill it\n"


def loads_only(module_source: str) -> str:
    """The CUDA family's rendered module with its key loop's body (dots, softmax, PV) removed: the
    warps only wait for their ring's copies and issue the next ones. Its output is meaningless; its
    time is the stream's alone at the same grid, ring and copies (session 25's probe measured this
    at b1 only, on its own kernel)."""
    start, end = module_source.index(LOOP_BODY_START), module_source.index(LOOP_BODY_END)
    return module_source[:start] + module_source[end:]


def launch_once(call, sets) -> float:
    """--once: one plain launch, untimed (ncu measures it); NaN stands for the time."""
    import torch

    call(*sets[0])
    torch.cuda.synchronize()
    return float("nan")


def time_mma(case, points, attention, folded, sets, fresh, traffic, module, attention_inputs, write_step, family,
             timer, ablate: bool = False):
    """The CUDA family's points on the same inputs: without the query's rope (its inputs less cos,
    sin), with it, and folded; the folded output against write-then-attend's; `ablate`: the bare
    kernel's loads alone too (`loads_only`)."""
    no_rope = without_rope(attention)
    rows = []
    for point in filter(None, points.split(",")):
        split, chunk, copy, warps, stages, *meet = point.split(":")
        params = {"SPLIT": int(split), "CHUNK": int(chunk), "COPY": copy, "num_warps": int(warps),
                  "num_stages": int(stages), "MEET": meet[0] if meet else "global"}
        problem = family.check(attention, params, H200)
        if problem is not None:  # e.g. 32-key bf16 chunks at 8 warps: past the shared memory
            print(f"  mma {point}: skipped ({problem})", flush=True)
            continue
        name = f"mma{split}_{chunk}{copy}{warps}_{stages}{'_cluster' if meet == ['cluster'] else ''}"
        bare, roped, fold = (module(r, family, params, f"{name}_{form}")
                             for r, form in ((no_rope, "bare"), (attention, "rope"), (folded, "folded")))
        bare_ms = timer(lambda *t: bare(*t[:4], *t[6:attention_inputs]), sets)
        if ablate:
            stream = module(no_rope, family, params, f"{name}_loads", patch=loads_only)
            loads_ms = timer(lambda *t: stream(*t[:4], *t[6:attention_inputs]), sets)
        rope_ms = timer(lambda *t: roped(*t[:attention_inputs]), sets)
        fold_ms = timer(fold, sets)
        a, b = [t.clone() for t in fresh[0]], [t.clone() for t in fresh[1]]
        write_step(*a)
        err = (roped(*a[:attention_inputs])[0].float() - fold(*b)[2].float()).abs().max().item()
        row = {"case": case, "mma": params, "bare_us": bare_ms * 1e3, "rope_us": rope_ms * 1e3,
               "folded_us": fold_ms * 1e3, "folded_tb_per_s": traffic / fold_ms / 1e9, "max_abs_diff": err}
        if ablate:
            row["loads_only_us"] = loads_ms * 1e3
        rows.append(row)
        print(f"  mma {point}: attention {row['bare_us']:6.2f} us, with rope {row['rope_us']:6.2f} us, folded "
              f"{row['folded_us']:6.2f} us ({row['folded_tb_per_s']:.2f} TB/s), outputs apart by {err:.1e}"
              + (f"; its loads alone {row['loads_only_us']:6.2f} us" if ablate else ""), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="b1-32768-fp8,b1-2048-fp8,b1-2048-rope")
    parser.add_argument("--splits", default="16,32", help="SPLIT_KV values timed (BLOCK_N 128, tl.dot, 4 warps, 3 stages); empty: none")
    parser.add_argument("--mma", default="16:16:ca:8:2,16:32:ca:8:2",
                        help="decode_attention_mma points SPLIT:CHUNK:COPY:warps:stages[:MEET], timed plain, with rope and "
                             "folded (cases it takes; points it does not admit are skipped)")
    parser.add_argument("--once", action="store_true", help="launch each kernel once, untimed (for ncu)")
    parser.add_argument("--loads-only", action="store_true",
                        help="also time each --mma point's kernel with its key loop's body removed (the stream alone)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.decode_attention import DecodeAttentionFamily, kv_bytes_read
    from coopt.templates.decode_attention_mma import DecodeAttentionMmaFamily, mma_problem
    from coopt.templates.kv_write import KvWriteFamily

    if not announce_gpu("bench/fold_kernel_times.py"):
        return 1
    timer = launch_once if args.once else graph_ms
    attention_family, write_family = DecodeAttentionFamily(), KvWriteFamily()
    work = Path("/tmp/fold-kernel-times")
    work.mkdir(exist_ok=True)
    rows = []
    cases = {**CASES, "b1-131072-fp8": (1, 131072, 131136, True)}
    for case in args.cases.split(","):
        batch, length, cache, fp8 = cases[case][:4]
        attention = make_region(batch, length, cache, fp8, rope=True)
        folded, write = folded_region(attention), write_region(attention)
        inputs = make_inputs(attention, length)
        gen = torch.Generator(device="cuda").manual_seed(1)
        k_new, v_new = (torch.randn(batch, 1, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
                        .transpose(1, 2) for _ in "kv")
        position = torch.tensor([length - 1], device="cuda")
        traffic = kv_bytes_read(attention, [length] * batch)
        sets = input_copies([*inputs, position, k_new, v_new], traffic)
        fresh = [[t.clone() for t in sets[0]] for _ in range(2)]  # one step each way from the same caches

        def module(region, family, params, name, patch=lambda source: source):
            assert family.check(region, params, H200) is None, family.check(region, params, H200)
            path = work / f"{case}_{name}.py"
            path.write_text(patch(family.render(region, params)))
            return load_module_from_file(path).run

        kv_write = module(write, write_family, advised(write, write_family)[0], "kv_write")
        attention_inputs = len(attention.inputs)
        scales = slice(6, 6 + 2 * fp8)  # an input set: q, k, v, lengths, cos, sin, [scales], position, k_new, v_new

        def write_step(*t):
            return kv_write(t[1], t[2], t[-3], t[-2], t[-1], t[4], t[5], *t[scales])

        write_ms = timer(write_step, sets)
        print(f"\n{case}: {traffic / 1e6:.1f} MB of valid K/V; kv_write alone {write_ms * 1e3:.2f} us", flush=True)
        # fp8: fp16 tiles, V loaded as bytes and as words (V_WORDS)
        variants = [{"TILE_FP16": True}, {"TILE_FP16": True, "V_WORDS": True}] if fp8 else [{}]
        for split, variant in ((s, v) for s in (int(x) for x in args.splits.split(",") if x) for v in variants):
            params = {"BLOCK_N": 128, "SPLIT_KV": split, "USE_DOT": True, "num_warps": 4, "num_stages": 3, **variant}
            words = bool(variant.get("V_WORDS"))
            plain = module(attention, attention_family, params, f"plain{split}{'w' if words else ''}")
            fold = module(folded, attention_family, params, f"folded{split}{'w' if words else ''}")
            plain_ms = timer(lambda *t: plain(*t[:attention_inputs]), sets)
            both_ms = timer(lambda *t: (write_step(*t), plain(*t[:attention_inputs])), sets)
            fold_ms = timer(fold, sets)
            # the same step both ways from the same caches: the outputs agree (bf16 rounding apart)
            a, b = fresh[0], [t.clone() for t in fresh[1]]
            write_step(*a)
            err = (plain(*a[:attention_inputs])[0].float() - fold(*b)[2].float()).abs().max().item()
            row = {"case": case, "split": split, "v_words": words, "plain_us": plain_ms * 1e3,
                   "write_then_plain_us": both_ms * 1e3, "folded_us": fold_ms * 1e3,
                   "folded_tb_per_s": traffic / fold_ms / 1e9, "max_abs_diff": err}
            rows.append(row)
            print(f"  split {split:2d}{' v-words' if words else '        '}: attention {row['plain_us']:6.2f} us, "
                  f"kv_write + attention {row['write_then_plain_us']:6.2f} us, folded {row['folded_us']:6.2f} us "
                  f"({row['folded_tb_per_s']:.2f} TB/s), outputs apart by {err:.1e}", flush=True)
        if mma_problem(attention) is None:
            rows += time_mma(case, args.mma, attention, folded, sets, fresh, traffic, module, attention_inputs,
                             write_step, DecodeAttentionMmaFamily(), timer, args.loads_only)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
