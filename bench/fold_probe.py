"""Which cache row a failing folded decode attention attended to: a probe of the repro scripts a
build writes (out/verify/repro/*.py) for decode_attention candidates with the cache write folded
in (attrs "kv_write").

Session 17: with the new row stored by its split before that split's key loop, every folded
build's verification failed on the H200 at magnitude 1000 while the template tests passed
there; session 18's probe showed a second run over the written caches failing alike (no stale
read) and unfolded builds failing too, which led to the multiply-and-sum scores' lanes
disagreeing (templates/triton/decode_attention.py.j2, _mul_rn). At that magnitude the softmax is
one-hot: each head's output is the V row of its top-scoring key, so the row an output equals
names what the kernel read. For each repro this prints the written position and the lengths,
then for the worst head of the first run: the reference's row, the row of the cache (as written,
or as it was before the write) that the candidate's output equals, and the error of a second run
of the candidate over the caches its first run wrote (a row read before its write lands reads
the written row the second time). A repro of a region without a folded write is named with its
build-time failure.

    python bench/fold_probe.py /tmp/build/out/verify/repro/*.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def probe(region_json: dict, reference_path: Path, candidate_path: Path, example_json: dict, device: str) -> dict:
    """The probe's findings for one repro (see the module docstring), as a dict."""
    import torch

    from coopt.ir.region import RegionSummary, kv_write_inputs
    from coopt.verify.check import _clones, _fp8_written, example_inputs, load_module, run_upcast
    from coopt.verify.strategies import Example

    region = RegionSummary.from_json(region_json)
    example = Example.from_json(example_json)
    at = kv_write_inputs(region)
    assert at is not None, f"{region.name}: no cache write folded in"
    reference, candidate = load_module(reference_path), load_module(candidate_path)
    inputs = example_inputs(region, example, device)
    v_before = inputs[2].clone()
    with torch.inference_mode():
        expected = run_upcast(reference, inputs, keep=_fp8_written(region))
        written = _clones(inputs)
        first = candidate.run(*written)
        second = candidate.run(*written)  # over the caches the first run wrote
    out, ref, v_after = first[2].double(), expected[2].double(), expected[1].double()
    err = (out - ref).abs().amax(dim=-1)[:, :, 0]  # [B, H]
    b, h = divmod(int(err.argmax()), err.shape[1])
    kv_head = h // (out.shape[1] // v_after.shape[1])

    def matching_row(cache: torch.Tensor, row: torch.Tensor) -> tuple[int, float]:
        """The row of (b, kv_head)'s cache most parallel to `row` and their cosine (scale-free:
        an fp8 cache's rows are the output over V's scale)."""
        rows = cache[b, kv_head].double()
        cosine = rows @ row / (rows.norm(dim=-1) * row.norm()).clamp_min(1e-300)
        return int(cosine.argmax()), round(float(cosine.max()), 6)

    ref_row, _ = matching_row(v_after, ref[b, h, 0])
    row_after, apart_after = matching_row(v_after, out[b, h, 0])
    row_before, apart_before = matching_row(v_before, out[b, h, 0])
    return {
        "region": region.name, "example": example.describe(),
        "position": inputs[at].flatten().tolist(), "lengths": inputs[region.attrs["lengths_input"]].flatten().tolist(),
        "first_run_err": float(err.max()), "second_run_err": float((second[2].double() - ref).abs().max()),
        "worst": [b, h], "reference_row": ref_row,
        "candidate_row_written_cache": [row_after, apart_after],
        "candidate_row_cache_before_write": [row_before, apart_before],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repros", nargs="*", type=Path, help="repro scripts a build wrote (out/verify/repro/*.py)")
    parser.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    args = parser.parse_args()
    from coopt.ir.region import RegionSummary, kv_write_inputs
    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.verify.runner import default_device

    device = args.device or default_device()
    if not args.repros:
        print("no repro scripts: every candidate verified")
    for path in args.repros:
        script = load_module_from_file(path)  # its constants; main() is not run
        if kv_write_inputs(RegionSummary.from_json(script.REGION)) is None:
            print(f"{path.name}: no cache write folded in; at build time: {script.__doc__.split('At build time: ')[1].split(chr(10))[0]}")
            continue
        found = probe(script.REGION, script.REFERENCE, script.CANDIDATE, script.EXAMPLE, device)
        print(f"{path.name}: {found}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
