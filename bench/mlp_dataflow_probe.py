"""Does the b32 MLP's down GEMV lose its ramp and the gate|up GEMV its tail when the two run in one
launch whose tasks wait only for the inputs they read? (issue 4, b32 / 2048 fp8: 4-5 µs a GEMV
over its bytes; the target needs 4.8 µs a layer.)

    python bench/mlp_dataflow_probe.py --json mlp_dataflow.json

At batch 32 every GEMV of a layer streams its weights at the copy's rate once running and pays
~4 µs beside it (session 39's fit: launch, ramp, the last programs running alone, the split-K
meeting). Session 24's persistent chain (bench/gemv_chain_probe.py, b1) put a grid-wide meeting
between the phases and gained nothing: a meeting waits for the slowest program, as a kernel
boundary does. This probe keeps the launch but drops the meeting. down's reduction runs over
silu(gate) * up's 14336 columns in GROUPS groups; a down task (128 output columns, one group)
needs only the gate|up tiles that produce its group, and counts them on that group's counter.
Programs take tasks from one ticket counter, all gate|up tiles first, then down's tasks group by
group: by the time a program takes group g's first down task, group g's gate|up tiles were taken
long ago and are done, so nothing waits but the last groups, and DRAM keeps streaming weights
across what was the boundary. A down task stores its fp32 partial; the last of a column tile's
GROUPS tasks sums them and adds the residual (the template's split-K meeting, in the launch).

Timed graph-replayed over input copies past the L2 (gemm.graph_ms), each against fp32 torch:
- `template`: the GEMV template at the heuristic's first points for the two GEMVs as a b32 build
  makes them (gate|up with the norm statistics' prologue and SwiGLU, down with the residual and
  the next norm's statistics), best of 3 each, one after the other;
- `launches`: this file's tasks as two launches (one task a program), what the merge is against;
- `dataflow`: one launch of P persistent programs over the same tasks.
The probe's gate|up reads an already normalised x and its down writes no norm statistics: the
template does a little more work (a few KB a task), the bytes streamed are the same.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import triton
import triton.language as tl

HIDDEN, FFN = 4096, 14336


@triton.jit
def _gate_up_task(x_ptr, w_ptr, act_ptr, t, M: tl.constexpr, HID: tl.constexpr, FFN: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DOT_F32: tl.constexpr):
    """act[:, tile t] = silu(x @ W_gate[tile]^T) * (x @ W_up[tile]^T), W = [gate; up] stacked;
    the dots transposed (weight rows as the dot's M) so a batch of 32 fills the dot's N."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M)
    offs_k = tl.arange(0, BLOCK_K)
    rows = t * BLOCK_N + offs_n
    gate_ptrs = w_ptr + rows.to(tl.int64)[:, None] * HID + offs_k[None, :]
    up_ptrs = gate_ptrs + FFN * HID
    x_ptrs = x_ptr + offs_m[None, :] * HID + offs_k[:, None]
    acc_gate = tl.zeros((BLOCK_N, M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, M), dtype=tl.float32)
    for kk in tl.range(0, HID // BLOCK_K, num_stages=STAGES):
        xt = tl.load(x_ptrs + kk * BLOCK_K)
        w_gate = tl.load(gate_ptrs + kk * BLOCK_K)
        w_up = tl.load(up_ptrs + kk * BLOCK_K)
        if DOT_F32:  # Triton's interpreter multiplies bf16 dots wrongly (shared/TRITON-INTERPRETER.md)
            xt, w_gate, w_up = xt.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        acc_gate = tl.dot(w_gate, xt, acc_gate)
        acc_up = tl.dot(w_up, xt, acc_up)
    gate = acc_gate.to(tl.bfloat16).to(tl.float32)  # rounded as torch's bf16 linear outputs are
    up = acc_up.to(tl.bfloat16).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(tl.bfloat16).to(tl.float32) * up
    tl.store(act_ptr + offs_m[None, :] * FFN + rows[:, None], act.to(tl.bfloat16))


@triton.jit
def _down_task(act_ptr, w_ptr, res_ptr, out_ptr, part_ptr, count_ptr, n_tile, group,
               M: tl.constexpr, HID: tl.constexpr, FFN: tl.constexpr, GROUPS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DOT_F32: tl.constexpr):
    """down's columns of tile n_tile over the reduction group `group`: an fp32 partial; the last
    of the tile's GROUPS tasks sums them, adds the residual and stores out (bf16)."""
    GROUP_K: tl.constexpr = FFN // GROUPS
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M)
    offs_k = tl.arange(0, BLOCK_K)
    rows = n_tile * BLOCK_N + offs_n
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * FFN + group * GROUP_K + offs_k[None, :]
    a_ptrs = act_ptr + offs_m[None, :] * FFN + group * GROUP_K + offs_k[:, None]
    acc = tl.zeros((BLOCK_N, M), dtype=tl.float32)
    for kk in tl.range(0, GROUP_K // BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptrs + kk * BLOCK_K)
        a = tl.load(a_ptrs + kk * BLOCK_K, cache_modifier=".cg")  # this launch's output: from L2, never a stale L1 line
        if DOT_F32:
            w, a = w.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(w, a, acc)
    tile = offs_m[None, :] * HID + rows[:, None]
    tl.store(part_ptr + group * M * HID + tile, acc)
    tl.debug_barrier()  # every thread's partial stored before the one arrival below
    arrived = tl.atomic_add(count_ptr + n_tile, 1, sem="acq_rel", scope="gpu")
    if arrived == GROUPS - 1:  # the last of the tile's groups: sum them, add the residual
        total = tl.zeros((BLOCK_N, M), dtype=tl.float32)
        for g in range(GROUPS):
            total += tl.load(part_ptr + g * M * HID + tile, cache_modifier=".cg")
        y = total.to(tl.bfloat16).to(tl.float32) + tl.load(res_ptr + tile).to(tl.float32)
        tl.store(out_ptr + tile, y.to(tl.bfloat16))
        tl.store(count_ptr + n_tile, 0)  # every other task of the tile has arrived: ready for the next launch


@triton.jit
def _mlp_kernel(x_ptr, w_gu_ptr, w_down_ptr, res_ptr, act_ptr, part_ptr, out_ptr, counters_ptr,
                PROGRAMS, M: tl.constexpr, HID: tl.constexpr, FFN: tl.constexpr, GROUPS: tl.constexpr,
                BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr,
                STAGES: tl.constexpr, MODE: tl.constexpr, DOT_F32: tl.constexpr):
    """MODE 0: the dataflow launch (tasks from the ticket counter, down's waiting on its group's
    gate|up tiles); MODE 1: gate|up, one tile a program; MODE 2: down, one task a program.
    counters: [ticket, programs out, ready[GROUPS], arrivals[HID // BLOCK_N2]]."""
    GU_TASKS: tl.constexpr = FFN // BLOCK_N1
    GU_PER_GROUP: tl.constexpr = GU_TASKS // GROUPS
    N2_TILES: tl.constexpr = HID // BLOCK_N2
    ready_ptr = counters_ptr + 2
    count_ptr = counters_ptr + 2 + GROUPS
    if MODE == 1:
        _gate_up_task(x_ptr, w_gu_ptr, act_ptr, tl.program_id(0), M, HID, FFN, BLOCK_N1, BLOCK_K1, STAGES, DOT_F32)
    elif MODE == 2:
        pid = tl.program_id(0)
        _down_task(act_ptr, w_down_ptr, res_ptr, out_ptr, part_ptr, count_ptr, pid % N2_TILES, pid // N2_TILES,
                   M, HID, FFN, GROUPS, BLOCK_N2, BLOCK_K2, STAGES, DOT_F32)
    else:
        task = tl.atomic_add(counters_ptr, 1, sem="relaxed", scope="gpu")
        while task < GU_TASKS + GROUPS * N2_TILES:
            if task < GU_TASKS:
                _gate_up_task(x_ptr, w_gu_ptr, act_ptr, task, M, HID, FFN, BLOCK_N1, BLOCK_K1, STAGES, DOT_F32)
                tl.debug_barrier()  # the tile's act stored by every thread before it counts as ready
                tl.atomic_add(ready_ptr + task // GU_PER_GROUP, 1, sem="release", scope="gpu")
            else:
                d = task - GU_TASKS
                group = d // N2_TILES
                seen = tl.atomic_add(ready_ptr + group, 0, sem="acquire", scope="gpu")
                while seen < GU_PER_GROUP:  # rare: only the last groups' tiles can still be running
                    seen = tl.atomic_add(ready_ptr + group, 0, sem="acquire", scope="gpu")
                _down_task(act_ptr, w_down_ptr, res_ptr, out_ptr, part_ptr, count_ptr, d % N2_TILES, group,
                           M, HID, FFN, GROUPS, BLOCK_N2, BLOCK_K2, STAGES, DOT_F32)
            task = tl.atomic_add(counters_ptr, 1, sem="relaxed", scope="gpu")
        # the last program out zeroes the ticket and the ready counts (every task is done)
        tl.debug_barrier()
        if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel", scope="gpu") == PROGRAMS - 1:
            tl.store(ready_ptr + tl.arange(0, GROUPS), tl.zeros((GROUPS,), dtype=tl.int32))
            tl.store(counters_ptr, 0)
            tl.store(counters_ptr + 1, 0)


class Mlp:
    """The probe at one point: `programs` > 0 is the dataflow launch, 0 the two launches."""

    def __init__(self, programs: int, batch: int, groups: int, block_n1: int, block_k1: int, block_n2: int,
                 block_k2: int, stages: int, warps: int, device, hidden: int = HIDDEN, ffn: int = FFN):
        import torch

        if ffn % (groups * block_n1) or (ffn // groups) % block_k2 or hidden % block_n2 or hidden % block_k1:
            raise ValueError(f"tiles do not divide the shapes (hidden {hidden}, ffn {ffn}, groups {groups})")
        if groups & (groups - 1):
            raise ValueError(f"groups={groups}: a power of two (tl.arange over the ready counts)")
        self.programs, self.batch, self.groups, self.hidden, self.ffn = programs, batch, groups, hidden, ffn
        self.knobs = dict(M=batch, HID=hidden, FFN=ffn, GROUPS=groups, BLOCK_N1=block_n1, BLOCK_K1=block_k1,
                          BLOCK_N2=block_n2, BLOCK_K2=block_k2, STAGES=stages, num_warps=warps,
                          DOT_F32=torch.device(device).type == "cpu")
        self.act = torch.empty(batch, ffn, device=device, dtype=torch.bfloat16)
        self.part = torch.empty(groups, batch, hidden, device=device, dtype=torch.float32)
        self.out = torch.empty(batch, hidden, device=device, dtype=torch.bfloat16)
        self.counters = torch.zeros(2 + groups + hidden // block_n2, device=device, dtype=torch.int32)

    def label(self) -> str:
        k = self.knobs
        grid = f"dataflow {self.programs}" if self.programs else "launches"
        return (f"{grid} g{self.groups} gu {k['BLOCK_N1']}x{k['BLOCK_K1']} down {k['BLOCK_N2']}x{k['BLOCK_K2']} "
                f"s{k['STAGES']} w{k['num_warps']}")

    def __call__(self, x, w_gu, w_down, residual):
        args = (x, w_gu, w_down, residual, self.act, self.part, self.out, self.counters)
        if self.programs:
            _mlp_kernel[(self.programs,)](*args, self.programs, MODE=0, **self.knobs)
        else:
            n2_tiles = self.hidden // self.knobs["BLOCK_N2"]
            _mlp_kernel[(self.ffn // self.knobs["BLOCK_N1"],)](*args, 0, MODE=1, **self.knobs)
            _mlp_kernel[(self.groups * n2_tiles,)](*args, 0, MODE=2, **self.knobs)
        return self.out


def reference(x, w_gu, w_down, residual):
    """The MLP as the model's bf16 linears compute it, in fp32 from the same bf16 inputs."""
    ffn = w_down.shape[1]
    gate_up = (x.float() @ w_gu.float().T).to(x.dtype).float()
    act = (gate_up[:, :ffn] * gate_up[:, :ffn].sigmoid()).to(x.dtype).float() * gate_up[:, ffn:]
    return act.to(x.dtype).float() @ w_down.float().T + residual.float()


def relative_error(got, expected) -> float:
    return ((got.float() - expected).abs().max() / expected.abs().max()).item()


def make_inputs(batch: int, hidden: int, ffn: int, device, seed: int = 0):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, hidden, generator=gen, device=device).to(torch.bfloat16)
    w_gu = (torch.randn(2 * ffn, hidden, generator=gen, device=device) / hidden ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(hidden, ffn, generator=gen, device=device) / ffn ** 0.5).to(torch.bfloat16)
    residual = torch.randn(batch, hidden, generator=gen, device=device).to(torch.bfloat16)
    return [x, w_gu, w_down, residual]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--programs-per-sm", default="1,2")
    parser.add_argument("--groups", default="4,8")
    parser.add_argument("--gate-up", default="64x128", help="BLOCK_NxBLOCK_K points of the gate|up tiles")
    parser.add_argument("--down", default="64x128,64x256,128x128", help="BLOCK_NxBLOCK_K points of the down tasks")
    parser.add_argument("--stages", default="3,4")
    parser.add_argument("--warps", default="4")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch
    from bandwidth import reference_bandwidth
    from gemm import announce_gpu, graph_ms, input_copies
    from gemv_chain_probe import timed_template_chain

    if not announce_gpu("bench/mlp_dataflow_probe.py", batch=args.batch):
        return 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inputs = make_inputs(args.batch, HIDDEN, FFN, "cuda")
    weight_bytes = (inputs[1].numel() + inputs[2].numel()) * 2
    sets = input_copies(inputs, weight_bytes)
    expected = reference(*inputs)
    floor_us = weight_bytes / reference_bandwidth() * 1e6
    print(f"gate|up + down at b{args.batch}: {weight_bytes / 1e6:.1f} MB of weights, floor {floor_us:.2f} us; "
          f"{sms} SMs; {len(sets)} input copies", flush=True)
    rows, best = [], {}
    try:
        work = Path("/tmp/mlp-dataflow-probe")
        work.mkdir(exist_ok=True)
        pair, rotation, alone_us, _ = timed_template_chain(  # as a b32 build makes them: norm statistics, SwiGLU, residual
            work, len(sets), ((args.batch, FFN, HIDDEN, "stats_swiglu"), (args.batch, HIDDEN, FFN, "producer")))
        best["template"] = graph_ms(pair, rotation) * 1e3
        rows.append({"kind": "template", "us": best["template"], "alone_us": alone_us})
        print(f"  template pair {best['template']:.2f} us (alone {sum(alone_us):.2f})", flush=True)
    except Exception as error:  # the probe's own points still run
        print(f"  template FAILED: {type(error).__name__}: {str(error)[:200]}", flush=True)

    def tiles(text):
        return [tuple(map(int, point.split("x"))) for point in text.split(",")]

    points = itertools.product(map(int, args.groups.split(",")), tiles(args.gate_up), tiles(args.down),
                               map(int, args.stages.split(",")), map(int, args.warps.split(",")))
    for groups, (bn1, bk1), (bn2, bk2), stages, warps in points:
        for per_sm in [0, *map(int, args.programs_per_sm.split(","))]:
            try:
                mlp = Mlp(sms * per_sm, args.batch, groups, bn1, bk1, bn2, bk2, stages, warps, "cuda")
                mlp(*inputs)
                err = relative_error(mlp.out, expected)
                us = graph_ms(mlp, sets) * 1e3
                mlp(*inputs)  # thousands of launches later (the counters): still right
                err = max(err, relative_error(mlp.out, expected))
                clean = mlp.counters.count_nonzero().item() == 0
            except Exception as error:  # e.g. out of shared memory at this point
                print(f"  g{groups} {bn1}x{bk1} {bn2}x{bk2} s{stages} w{warps} x{per_sm} FAILED: "
                      f"{type(error).__name__}: {str(error)[:160]}", flush=True)
                continue
            wrong = not (err < 2e-2 and clean)
            kind = "dataflow" if per_sm else "launches"
            rows.append({"kind": kind, "point": mlp.label(), "us": us, "tb_per_s": weight_bytes / us / 1e6,
                         "err": err, "counters_clean": clean, "wrong": wrong})
            print(f"  {mlp.label():52s} {us:7.2f} us {weight_bytes / us / 1e6:5.2f} TB/s  err {err:.1e}"
                  + ("  WRONG" if wrong else ""), flush=True)
            if not wrong:
                best[kind] = min(best.get(kind, us), us)
    print(f"\nbest of each kind, µs (floor {floor_us:.2f}: {weight_bytes / 1e6:.1f} MB at "
          f"{reference_bandwidth() / 1e12:.2f} TB/s)")
    for kind, us in best.items():
        print(f"  {kind:10s} {us:7.2f}  {weight_bytes / us / 1e6:5.2f} TB/s  {us / floor_us:.3f}x floor")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
