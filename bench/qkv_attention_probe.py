"""Is the q|k|v GEMV and the decode attention in one launch faster than the two launches a b1
build runs today? (issue 3, b1 / 2048: the attention's ~8 µs of fixed latency a layer.)

    python bench/qkv_attention_probe.py --cases 2048,32768 --json qkv_attention.json

A b1 layer runs the q|k|v GEMV (RMSNorm in its prologue, 50 MB of weights) and then the folded
decode attention (q and K rotated, the new K/V row written, split-KV, the splits merged in the
launch). The attention at 2048 keys takes ~8-10 µs for 8.4 MB: mostly a chain of dependent round
trips (the length, q, the first K/V tile, the partials and the arrival count), paid after the
GEMV's tail and a kernel boundary.

The probe kernel here (not a template: an experiment; it lives in this file) runs both in one
grid of (SPLIT, 8 kv heads) programs: each program first computes its share of its kv head's 768
q|k|v columns (512 of q, 128 of k, 128 of v; RMSNorm folded as the GEMV template folds it),
stores them to a workspace, and meets the other splits of its kv head at a counter (all of one
kv head's splits are resident: the grid is ordered split-fastest so a kv head's programs
dispatch together); then it runs the folded attention of that kv head over its split of the keys
and the splits merge as the template's in-launch meeting does. With PREFETCH each program loads
its first K/V tile before it waits at the counter, so the tile's DRAM round trip overlaps the
other splits' GEMV tails; the tile's row at the new position is patched in registers.

Timed, each replayed in a CUDA graph over input copies past the L2 (gemm.graph_ms):
- `project`: the template GEMV at the heuristic's first points (best kept) then the template's
  folded attention (split as given, BLOCK_N 128, tl.dot, 4 warps, 3 stages), in one graph;
- `probe-pair`: this file's kernel as two launches (PHASE 1: the GEMV part; PHASE 2: the
  attention part), which isolates what fusing saves from how good the probe's GEMV is;
- `fused`: one launch, over its knobs (warps, GEMV BLOCK_K and stages, PREFETCH).
Each point's output is checked against the `project` pair's (bf16 apart) before it is timed.
Bandwidth is (q|k|v weights + valid K/V bytes) over the time; the floor is those bytes over
bench/bandwidth.py's reference (4.2 TB/s on an H200, the measured copy elsewhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bandwidth import reference_bandwidth  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 32, 8, 128, 4096
GROUP = HEADS // KV_HEADS
GROUP_COLS = (GROUP + 2) * HEAD_DIM  # one kv head's q|k|v columns: 512 + 128 + 128


@triton.jit
def _tile(q, k, v, key_ok, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr):
    """One K/V tile into the online softmax (base 2, fp32 statistics). UPCAST: fp32 dots (Triton's
    interpreter computes bf16 tl.dot wrongly; never on a GPU)."""
    if UPCAST:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(key_ok[None, :], scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _qkv_attention_kernel(
    x_ptr, g_ptr, w_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr,
    qkv_ptr, sync_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, arrivals_ptr,
    max_length, stride_kh, stride_ks, stride_vh, stride_vs, qk_scale, eps,
    K: tl.constexpr, BLOCK_K: tl.constexpr, COLS: tl.constexpr, BLOCK_C: tl.constexpr, GEMV_STAGES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
    PHASE: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr,
):
    """PHASE 0: GEMV, the kv head's meeting, attention; 1: the GEMV part only; 2: the attention
    part only (reading the workspace PHASE 1 wrote). Batch 1."""
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    QW = GROUP * HEAD_DIM
    GW = QW + 2 * HEAD_DIM
    pos = tl.load(pos_ptr).to(tl.int32)
    length = tl.minimum(tl.maximum(pos + 1, 0), max_length)
    chunk = tl.cdiv(tl.cdiv(length, SPLIT), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    if PHASE != 2:
        # this split's COLS of the kv head's GW virtual columns -> weight rows (q, then k, then v)
        offs_c = tl.arange(0, BLOCK_C)
        vc = split * COLS + offs_c
        c_ok = offs_c < COLS
        rows = tl.where(vc < QW, kv_head * QW + vc,
                        tl.where(vc < QW + HEAD_DIM, NUM_HEADS * HEAD_DIM + kv_head * HEAD_DIM + vc - QW,
                                 (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_head * HEAD_DIM + vc - QW - HEAD_DIM))
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
        x_ptrs = x_ptr + offs_k
        g_ptrs = g_ptr + offs_k
        squares = tl.zeros((1, BLOCK_K), dtype=tl.float32)
        acc_c = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for kk in tl.range(0, K // BLOCK_K, num_stages=GEMV_STAGES):
            x = tl.load(x_ptrs).to(tl.float32)
            w = tl.load(w_ptrs, mask=c_ok[:, None], other=0.0)
            gw = tl.load(g_ptrs).to(tl.float32)
            squares += (x * x)[None, :]
            acc_c += tl.sum(w.to(tl.float32) * (x * gw)[None, :], axis=1)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
        rstd = tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / K + eps)
        tl.store(qkv_ptr + kv_head * GW + vc, (acc_c * rstd).to(tl.bfloat16), mask=c_ok)
    if PREFETCH:  # after the GEMV (its registers free), before the wait
        keys0 = start + offs_n
        ok0 = keys0 < end
        k0 = tl.load(k_base + keys0[:, None] * stride_ks + offs_d[None, :], mask=ok0[:, None], other=0.0)
        v0 = tl.load(v_base + keys0[:, None] * stride_vs + offs_d[None, :], mask=ok0[:, None], other=0.0)
    if PHASE == 0:
        # the kv head's splits meet: every store above is released before this split counts in
        tl.debug_barrier()
        seen = tl.atomic_add(sync_ptr + kv_head, 1, sem="acq_rel", scope="gpu") + 1
        while seen < SPLIT:
            seen = tl.atomic_add(sync_ptr + kv_head, 0, sem="acquire", scope="gpu")
    if PHASE != 1:
        offs_h = tl.arange(0, BLOCK_H)
        head_ok = offs_h < GROUP
        half = HEAD_DIM // 2
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        sign = tl.where(offs_d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + offs_d).to(tl.float32)
        sin = tl.load(sin_ptr + offs_d).to(tl.float32)
        q_rows = qkv_ptr + kv_head * GW + offs_h[:, None] * HEAD_DIM
        # .cg: the other splits' stores are at L2, never in this SM's L1
        q = tl.load(q_rows + offs_d[None, :], mask=head_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        qp = tl.load(q_rows + partner[None, :], mask=head_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        q = (q * cos[None, :] + sign[None, :] * qp * sin[None, :]).to(tl.bfloat16)
        writes_new = (pos >= start) & (pos < end)
        if writes_new:
            kn = qkv_ptr + kv_head * GW + QW
            k_new = tl.load(kn + offs_d, cache_modifier=".cg").to(tl.float32)
            k_par = tl.load(kn + partner, cache_modifier=".cg").to(tl.float32)
            k_new = (k_new * cos + sign * k_par * sin).to(tl.bfloat16)
            v_new = tl.load(kn + HEAD_DIM + offs_d, cache_modifier=".cg")
            tl.store(k_base + pos * stride_ks + offs_d, k_new)
            tl.store(v_base + pos * stride_vs + offs_d, v_new)
            if PREFETCH:
                k0 = tl.where((keys0 == pos)[:, None], k_new[None, :], k0)
                v0 = tl.where((keys0 == pos)[:, None], v_new[None, :], v0)
            tl.debug_barrier()
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        first = start
        if PREFETCH:
            m_i, l_i, acc = _tile(q, k0, v0, ok0, m_i, l_i, acc, qk_scale, UPCAST)
            first = start + BLOCK_N
        for block_start in tl.range(first, end, BLOCK_N, num_stages=NUM_STAGES):
            keys = block_start + offs_n
            key_ok = keys < end
            k = tl.load(k_base + keys[:, None] * stride_ks + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            v = tl.load(v_base + keys[:, None] * stride_vs + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            m_i, l_i, acc = _tile(q, k, v, key_ok, m_i, l_i, acc, qk_scale, UPCAST)
        part = (kv_head * GROUP + offs_h) * SPLIT + split
        written = offs_h < tl.where(start < end, GROUP, 0)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=written[:, None])
        tl.store(part_m_ptr + part, m_i, mask=written)
        tl.store(part_l_ptr + part, l_i, mask=written)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + kv_head, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            offs_s = tl.arange(0, SPLIT)
            seen_keys = offs_s * chunk < length
            merged = head_ok[:, None] & seen_keys[None, :]
            row = (kv_head * GROUP + offs_h)[:, None] * SPLIT + offs_s[None, :]
            pm = tl.load(part_m_ptr + row, mask=merged, other=-1.0e30, cache_modifier=".cg")
            pl = tl.load(part_l_ptr + row, mask=merged, other=0.0, cache_modifier=".cg")
            pa = tl.load(part_acc_ptr + row[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=merged[:, :, None],
                         other=0.0, cache_modifier=".cg")
            weight = tl.where(merged, tl.exp2(pm - tl.max(pm, 1)[:, None]), 0.0)
            l_g = tl.sum(pl * weight, 1)
            out = tl.sum(pa * weight[:, :, None], 1) / tl.where(l_g == 0.0, 1.0, l_g)[:, None]
            tl.store(o_ptr + (kv_head * GROUP + offs_h)[:, None] * HEAD_DIM + offs_d[None, :], out.to(tl.bfloat16),
                     mask=head_ok[:, None])
            tl.store(arrivals_ptr + kv_head, 0)
            tl.store(sync_ptr + kv_head, 0)


class Probe:
    """The probe kernel at one point, with its workspace (batch 1; Llama-3-8B heads unless given)."""

    def __init__(self, split: int, warps: int, block_k: int, gemv_stages: int, prefetch: bool, device,
                 heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, hidden: int = HIDDEN):
        import torch

        self.split, self.warps, self.block_k, self.gemv_stages, self.prefetch = split, warps, block_k, gemv_stages, prefetch
        self.heads, self.kv_heads, self.head_dim, self.hidden = heads, kv_heads, head_dim, hidden
        group_cols = (heads // kv_heads + 2) * head_dim
        self.cols = group_cols // split
        assert self.cols * split == group_cols, f"{group_cols} columns do not split {split} ways"
        parts = heads * split
        self.qkv = torch.empty(kv_heads * group_cols, device=device, dtype=torch.bfloat16)
        self.sync = torch.zeros(kv_heads, device=device, dtype=torch.int32)
        self.arrivals = torch.zeros(kv_heads, device=device, dtype=torch.int32)
        self.part_acc = torch.empty(parts * head_dim, device=device, dtype=torch.float32)
        self.part_m = torch.empty(parts, device=device, dtype=torch.float32)
        self.part_l = torch.empty(parts, device=device, dtype=torch.float32)

    def label(self) -> str:
        return (f"split {self.split} w{self.warps} BK{self.block_k} s{self.gemv_stages}"
                + (" prefetch" if self.prefetch else ""))

    def launch(self, phase, x, g, w, k_cache, v_cache, cos, sin, pos, out):
        _qkv_attention_kernel[(self.split, self.kv_heads)](
            x, g, w, k_cache, v_cache, cos, sin, pos, out,
            self.qkv, self.sync, self.part_acc, self.part_m, self.part_l, self.arrivals,
            k_cache.shape[2], k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
            self.head_dim ** -0.5 * 1.4426950408889634, 1e-5,
            K=self.hidden, BLOCK_K=self.block_k, COLS=self.cols, BLOCK_C=triton.next_power_of_2(self.cols),
            GEMV_STAGES=self.gemv_stages, BLOCK_H=16, BLOCK_N=128, HEAD_DIM=self.head_dim,
            GROUP=self.heads // self.kv_heads, NUM_HEADS=self.heads, NUM_KV_HEADS=self.kv_heads, SPLIT=self.split,
            NUM_STAGES=3,
            PHASE=phase, PREFETCH=self.prefetch and phase != 1,
            UPCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=self.warps,
        )
        return out

    def fused(self, x, g, w, k_cache, v_cache, cos, sin, pos, out):
        return self.launch(0, x, g, w, k_cache, v_cache, cos, sin, pos, out)

    def pair(self, x, g, w, k_cache, v_cache, cos, sin, pos, out):
        self.launch(1, x, g, w, k_cache, v_cache, cos, sin, pos, out)
        return self.launch(2, x, g, w, k_cache, v_cache, cos, sin, pos, out)


def project_pair(length: int, split: int, work: Path):
    """The template kernels a b1 build runs: ([(label, run)] of the GEMV's first 3 points, the folded
    attention's run, the cache's positions)."""
    from attention_sweep import make_region as attention_region
    from fold_kernel_times import folded_region
    from gemm import advised_points, label, make_region

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.targets import H200
    from coopt.templates.decode_attention import DecodeAttentionFamily
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    gemv_region = make_region(1, GROUP_COLS * KV_HEADS, HIDDEN, "norm")
    gemvs = []
    for i, params in enumerate(advised_points(gemv_region, 3)):
        path = work / f"gemv_{i}.py"
        path.write_text(MatmulEpilogueFamily().render(gemv_region, params))
        gemvs.append((label(params), load_module_from_file(path).run))
    cache = 4096 if length <= 4096 else length + 64
    folded = folded_region(attention_region(1, length, cache, False, rope=True))
    params = {"BLOCK_N": 128, "SPLIT_KV": split, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
    family = DecodeAttentionFamily()
    assert family.check(folded, params, H200) is None, family.check(folded, params, H200)
    path = work / f"folded_{length}_{split}.py"
    path.write_text(family.render(folded, params))
    return gemvs, load_module_from_file(path).run, cache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="2048,32768", help="valid lengths (batch 1)")
    parser.add_argument("--splits", default="16:2048,32:32768", help="the attention's SPLIT per length, split:length pairs")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--block-k", default="128,256")
    parser.add_argument("--gemv-stages", default="3,4")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch

    from gemm import announce_gpu, graph_ms, input_copies

    if not announce_gpu("bench/qkv_attention_probe.py"):
        return 1
    splits = {int(length): int(split) for split, length in (p.split(":") for p in args.splits.split(","))}
    work = Path("/tmp/qkv-attention-probe")
    work.mkdir(exist_ok=True)
    rows, table = [], []
    for length in map(int, args.cases.split(",")):
        split = splits[length]
        gemvs, folded, cache = project_pair(length, split, work)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        g = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")).to(torch.bfloat16)
        w = (torch.randn(KV_HEADS * GROUP_COLS, HIDDEN, generator=gen, device="cuda") / HIDDEN ** 0.5).to(torch.bfloat16)
        k_cache, v_cache = (torch.randn(1, KV_HEADS, cache, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
                            for _ in "kv")
        angles = torch.rand(1, HEAD_DIM, generator=gen, device="cuda") * 6.283
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        pos = torch.tensor([length - 1], device="cuda")
        lengths = torch.tensor([length], device="cuda", dtype=torch.int32)
        out = torch.empty(1, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        inputs = [x, g, w, k_cache, v_cache, cos, sin, pos, out]
        kv_bytes = 2 * KV_HEADS * length * HEAD_DIM * 2
        traffic = w.numel() * 2 + kv_bytes
        sets = input_copies(inputs, traffic)

        def project(gemv):
            def step(x, g, w, k_cache, v_cache, cos, sin, pos, out):
                y = gemv(x, w, g)[0]
                q = y[:, :HEADS * HEAD_DIM].view(1, HEADS, 1, HEAD_DIM)
                k_new = y[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(1, KV_HEADS, 1, HEAD_DIM)
                v_new = y[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(1, KV_HEADS, 1, HEAD_DIM)
                return folded(q, k_cache, v_cache, lengths, cos, sin, pos, k_new, v_new)[2]
            return step

        def checked(name, call):
            """The step's output and new cache row against the project pair's, from the same caches."""
            a, b = ([t.clone() for t in sets[0]] for _ in range(2))
            expected = project(gemvs[0][1])(*a).float()
            got = call(*b).float()
            # relative to the largest element: the two GEMVs round their outputs to bf16 apart
            err = ((got - expected).abs().max() / expected.abs().max()).item()
            rows_err = max(((b[i][0, :, length - 1].float() - a[i][0, :, length - 1].float()).abs().max()
                            / a[i][0, :, length - 1].float().abs().max()).item() for i in (3, 4))
            ok = err < 2e-2 and rows_err < 2e-2
            if not ok:
                print(f"  {name}: WRONG (out apart by {err:.2e}, new rows by {rows_err:.2e}, relative)", flush=True)
            return ok, err

        def record(kind, name, call):
            """Check, time and check again; the best right time of each kind goes to `best`."""
            ok, err = checked(name, call)
            if not ok:
                rows.append({"length": length, "kind": kind, "point": name, "wrong": True, "err": err})
                return
            us = graph_ms(call, sets) * 1e3
            ok_after, err_after = checked(name, call)  # after thousands of replays
            row = {"length": length, "kind": kind, "point": name, "us": us, "tb_per_s": traffic / us / 1e6,
                   "err": max(err, err_after), "wrong": not ok_after}
            rows.append(row)
            print(f"  {kind:10s} {name:40s} {us:7.2f} us {row['tb_per_s']:5.2f} TB/s  err {row['err']:.1e}"
                  + (" WRONG after timing" if not ok_after else ""), flush=True)
            if ok_after:
                best[kind] = min(best.get(kind, us), us)

        floor_us = traffic / reference_bandwidth() * 1e6
        print(f"\nb1 / {length}: split {split}, {w.numel() * 2 / 1e6:.1f} MB of q|k|v weights + {kv_bytes / 1e6:.1f} MB "
              f"of K/V, floor {floor_us:.2f} us; {len(sets)} input copies", flush=True)
        attn_only = graph_ms(lambda x, g, w, k, v, c, s, p, o: folded(
            o, k, v, lengths, c, s, p, k[:, :, :1], v[:, :, :1]), sets) * 1e3
        print(f"  project folded attention alone {attn_only:.2f} us", flush=True)
        best = {}
        for name, gemv in gemvs:
            gemv_us = graph_ms(lambda x, g, w, *rest: gemv(x, w, g), sets) * 1e3
            print(f"  project GEMV {name} alone {gemv_us:.2f} us", flush=True)
            record("project", name, project(gemv))
        for warps, block_k, stages in itertools.product(map(int, args.warps.split(",")), map(int, args.block_k.split(",")),
                                                         map(int, args.gemv_stages.split(","))):
            plain = Probe(split, warps, block_k, stages, False, "cuda")
            record("probe-pair", plain.label(), plain.pair)
            for prefetch in (False, True):
                probe = Probe(split, warps, block_k, stages, prefetch, "cuda")
                record("fused+prefetch" if prefetch else "fused", probe.label(), probe.fused)
        table.append((length, floor_us, best))
    print(f"\nbest of each kind, µs (floor: q|k|v weights + K/V at {reference_bandwidth() / 1e12:.2f} TB/s)")
    print(f"{'length':>7s} {'floor':>7s} " + " ".join(f"{k:>15s}" for k in ("project", "probe-pair", "fused", "fused+prefetch")))
    for length, floor_us, best in table:
        print(f"{length:7d} {floor_us:7.2f} " + " ".join(
            f"{best[k]:15.2f}" if k in best else f"{'-':>15s}" for k in ("project", "probe-pair", "fused", "fused+prefetch")))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
