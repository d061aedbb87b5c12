"""Does PDL pay on a chain of the CUDA GEMV family's own modules, and do two-block grids spoil it?
(issue 3, session 31)

    python bench/gemv_cuda_pdl_chain.py --sets "16:1:6:1:1/16:2:4:1:1/16:1:6:1:0;16:1:6:2:1/16:2:4:1:1/16:1:6:1:0"

Session 31's b1 / 32768 fp8 build put q|k|v, o and gate|up in gemv_cuda (o with two blocks an
SM) and its launch step measured PDL for them 280 µs a step slower, while session 30's probe
(bench/cuda_gemv_pdl_probe.py, one block an SM, no norm or epilogues) had o -> gate|up -> down
2-3 µs faster with PDL. This times that triple as the build renders it (o + bias + residual,
gate|up + RMSNorm + SwiGLU, down + bias + residual: bench/gemm.py's regions, each module from
the family) graph-replayed over weight copies past the L2, each set of points without and with
PDL, beside the template's three GEMVs at their best first points. A set is three points
`WARPS:ROWS:STAGES:BLOCKS:STAGGER` (o / gate|up / down) and sets are separated by `;`. Each
chain's output is checked against torch's on the chain's own intermediates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bandwidth import reference_bandwidth  # noqa: E402

from gemm import cuda_point, label  # noqa: E402

HIDDEN, FFN = 4096, 14336
SHAPES = ((1, HIDDEN, HIDDEN, "residual"), (1, FFN, HIDDEN, "norm_swiglu"), (1, HIDDEN, FFN, "residual"))
DEFAULT_SETS = ("16:1:6:1:1/16:2:4:1:1/16:1:6:1:0;"  # one block an SM throughout
                "16:1:6:2:1/16:2:4:1:1/16:1:6:1:0;"  # o at two blocks (the build's o)
                "8:2:6:2:1/8:2:4:2:1/16:1:6:2:0")    # two blocks throughout


def parse_sets(text: str) -> list[list[dict]]:
    """'W:R:S:B:G/W:R:S:B:G/W:R:S:B:G;...' -> a list of (o, gate|up, down) points."""
    sets = []
    for chunk in text.split(";"):
        points = chunk.split("/")
        if len(points) != 3 or any(len(p.split(":")) != 5 for p in points):
            raise ValueError(f"a set is three WARPS:ROWS:STAGES:BLOCKS:STAGGER points joined by '/', got {chunk!r}")
        sets.append([cuda_point(p.split(":")) for p in points])
    return sets


def set_label(points: list[dict]) -> str:
    return " / ".join(label(p).removeprefix("cuda ") for p in points)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=DEFAULT_SETS, help="';'-separated sets of three points (o/gate|up/down)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        sets = parse_sets(args.sets)
    except ValueError as error:
        print(f"bench/gemv_cuda_pdl_chain.py: {error}", file=sys.stderr)
        return 2
    from gemm import announce_gpu, graph_ms, input_copies, make_inputs, make_region
    from gemv_chain_probe import timed_template_chain

    if not announce_gpu("bench/gemv_cuda_pdl_chain.py"):
        return 2
    import torch
    import torch.nn.functional as F

    from coopt.runtime.kernel_loader import load_module_from_source
    from coopt.targets import H200
    from coopt.templates.gemv_cuda import GemvCudaFamily

    family = GemvCudaFamily()
    regions = [make_region(*shape) for shape in SHAPES]
    # operands: x, then o's (w, bias, residual), gate|up's (w, g), down's (w, bias); down's residual is o's output
    (x, w1, b1, r1), (_, w2, g2), (_, w3, b3, _) = (make_inputs(r, seed) for seed, r in enumerate(regions))
    weight_bytes = sum(w.numel() * 2 for w in (w1, w2, w3))
    copies = input_copies([x, w1, b1, r1, w2, g2, w3, b3], weight_bytes)
    print(f"o -> gate|up -> down at b1: {weight_bytes / 1e6:.1f} MB of weights, floor "
          f"{weight_bytes / reference_bandwidth() * 1e6:.2f} us; {len(copies)} weight copies", flush=True)

    def expected(x, w1, b1, r1, w2, g2, w3, b3, y1, y2):
        """torch's three outputs, each from the chain's own input to it."""
        e1 = F.linear(x, w1, b1).float() + r1.float()
        e2 = F.linear(F.rms_norm(y1, (HIDDEN,), g2, 1e-5), w2).float()
        e2 = F.silu(e2[..., :FFN]) * e2[..., FFN:]
        e3 = F.linear(y2, w3, b3).float() + y1.float()
        return e1, e2, e3

    work = Path("/tmp/gemv-cuda-pdl-chain")
    work.mkdir(exist_ok=True)
    template, rotation, alone_us, _ = timed_template_chain(work, len(copies))
    template_us = graph_ms(template, rotation) * 1e3
    rows = [{"kind": "template", "us": template_us, "alone_us": alone_us}]
    print(f"  {'template (three launches)':76s} {template_us:7.2f} us", flush=True)

    for i, points in enumerate(sets):
        problems = [family.check(r, p, H200) for r, p in zip(regions, points)]
        if any(problems):
            print(f"  {set_label(points)}: {'; '.join(filter(None, problems))}", flush=True)
            continue
        modules = [load_module_from_source(family.render(r, p), work / f"set{i}", f"gemv{j}")
                   for j, (r, p) in enumerate(zip(regions, points))]
        o, gate_up, down = (m.run for m in modules)

        def chain(x, w1, b1, r1, w2, g2, w3, b3):
            y1 = o(x, w1, b1, r1)[0]
            y2 = gate_up(y1, w2, g2)[0]
            return y1, y2, down(y2, w3, b3, y1)[0]

        for pdl in (False, True):
            for m in modules:
                m.use_pdl(pdl)
            y1, y2, y3 = chain(*copies[0])
            torch.cuda.synchronize()
            err = max(((got.float() - e).abs().max() / e.abs().max()).item()
                      for got, e in zip((y1, y2, y3), expected(*copies[0], y1, y2)))
            us = graph_ms(lambda *ops: chain(*ops), copies) * 1e3
            rows.append({"kind": "gemv_cuda", "points": points, "pdl": pdl, "us": us, "err": err})
            name = f"{set_label(points)}{', PDL' if pdl else ''}"
            print(f"  {name:76s} {us:7.2f} us {weight_bytes / us / 1e6:5.2f} TB/s  err {err:.1e}"
                  + ("" if err < 2e-2 else "  WRONG"), flush=True)
        for m in modules:
            m.use_pdl(False)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
