"""The SASS the GPU machine's toolchain makes of the CUDA family's kernel and of the fp8 probe's,
side by side: the PTX from torch's NVRTC (what DriverKernel loads), assembled for sm_90a by the
machine's ptxas, disassembled by cuobjdump, and each loop's length in instructions.

Session 26 found the family's kernel (templates/decode_attention_mma.py) 2-3.5 µs slower than
the probe's at b1 / 32768; session 27 compared their SASS here (the main loops alike: 325 against
339 instructions) and found the difference before the loop with ncu's source counters
(`bash bench/gpu_session.sh mma-sass`).

    python bench/cuda_sass.py --out sass/ --chunks 16,32

Writes <name>.cu, .ptx, .sass under --out and prints a table: registers, static instructions,
and every backward branch (a loop) with its length.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attention_sweep import make_region  # noqa: E402
from cuda_fp8_attention_probe import render  # noqa: E402
from fold_kernel_times import without_rope  # noqa: E402


def family_source(chunk: int) -> str:
    """The family's CUDA source for fold_kernel_times' b1 / 32768 fp8 case without the query's rope."""
    from coopt.templates.decode_attention_mma import DecodeAttentionMmaFamily

    bare = without_rope(make_region(1, 32768, 32832, True, rope=True))
    params = {"SPLIT": 16, "CHUNK": chunk, "COPY": "ca", "num_warps": 8, "num_stages": 2}
    module = DecodeAttentionMmaFamily().render(bare, params)
    return re.search(r'SOURCE = r"""\n(.*?)"""', module, re.S).group(1)


def tool(name: str) -> str | None:
    """A CUDA toolkit program on the PATH or in /usr/local/cuda/bin (the GPU machine's), else None."""
    toolkit = Path("/usr/local/cuda/bin") / name
    return shutil.which(name) or (str(toolkit) if toolkit.exists() else None)


def loops(sass: str) -> tuple[int, list[int]]:
    """(instructions, length of each backward branch's loop) of a cuobjdump -sass listing."""
    at = [int(m.group(1), 16) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+\S", sass)]
    index = {a: i for i, a in enumerate(at)}
    lengths = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/[^;\n]*BRA[^;\n]*?0x([0-9a-f]+)", sass):
        here, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < here and target in index:
            lengths.append(index[here] - index[target])
    return len(at), lengths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("sass"))
    parser.add_argument("--chunks", default="16,32")
    args = parser.parse_args()
    from coopt.runtime.cuda_kernels import nvrtc_ptx

    args.out.mkdir(parents=True, exist_ok=True)
    ptxas, cuobjdump = tool("ptxas"), tool("cuobjdump")
    print(f"ptxas {ptxas}, cuobjdump {cuobjdump}")
    for chunk in map(int, args.chunks.split(",")):
        for name, source in ((f"family{chunk}", family_source(chunk)),
                             (f"probe{chunk}", render(16, 8, chunk, 2, "global", widen="cvt", copy="ca"))):
            (args.out / f"{name}.cu").write_text(source)
            ptx = nvrtc_ptx(source, "90a").rstrip(b"\0")
            (args.out / f"{name}.ptx").write_bytes(ptx)
            if not (ptxas and cuobjdump):
                continue
            cubin = args.out / f"{name}.cubin"
            done = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", str(cubin), str(args.out / f"{name}.ptx")],
                                  capture_output=True, text=True)
            registers = re.search(r"Used (\d+) registers", done.stderr)
            sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
            (args.out / f"{name}.sass").write_text(sass)
            count, lengths = loops(sass)
            print(f"{name:10s} registers {registers.group(1) if registers else '?':>4s}  instructions {count:5d}  "
                  f"loops {lengths}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
