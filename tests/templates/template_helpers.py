"""Helpers shared by the template tests: covering points, running a candidate, sm_90 compilation.

A plain module (not conftest) so tests can import it; the name is unique across test folders.

- `covering_points(points)`: a few points that together use every value of every knob.
- `run_candidate(family, target, load_candidate, region, params, inputs, stem)`: check the point
  is legal, render it, import it and call its `run(*inputs)`.
- `compile_for_hopper(jobs, tmp_path, machine_code=False)`: compile for sm_90 (Hopper) every kernel that each job's
  `run(*inputs)` launches, without a GPU, in a fresh process (this file is also that process's
  script: `python template_helpers.py JOBS RESULTS [--machine-code]`). Arguments are specialised as a real
  launch does (16-byte aligned pointers and ints divisible by 16 marked so, ints equal to 1
  and None made constexpr, tensor descriptors typed): without that nothing is vectorised or
  pipelined, and the pipelining checks would mean nothing. Catches what only the real compiler
  rejects (loop-carried type changes, bad constexpr use) and the interpreter happily runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_TRITON_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.bool: "i1",
                torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def covering_points(points: list[dict]) -> list[dict]:
    """A few points that together use every value of every knob (greedy, deterministic)."""
    todo = {(k, v) for p in points for k, v in p.items()}
    chosen = []
    while todo:
        best = max(points, key=lambda p: len(todo & set(p.items())))
        chosen.append(best)
        todo -= set(best.items())
    return chosen


def run_candidate(family, target, load_candidate, region, params, inputs, stem="candidate"):
    """Render `params` for `region` (which must be legal on `target`), import it, run it."""
    assert family.check(region, params, target) is None, family.check(region, params, target)
    module = load_candidate(family.render(region, params), stem)
    return module.run(*on_test_device(inputs))


def on_test_device(inputs):
    """Tests build inputs on the CPU; on the GPU machine the kernels launch there, so move them."""
    if not torch.cuda.is_available():
        return list(inputs)
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]


# -- sm_90 compilation ------------------------------------------------------------------

def compile_for_hopper(jobs, tmp_path, machine_code: bool = False) -> dict:
    """Compile for sm_90 every kernel that each job's `run(*inputs)` launches.

    jobs: [(label, source, inputs)]. Returns {label: {kernel: facts}}, facts being "launches",
    "wgmma", "pipelined", "tma", "warp_specialized", "shared" and, with machine_code where
    cuobjdump runs, "registers", "stack_bytes", "spill_instructions", "loop_byte_shared_loads", "loop_instructions", "hgmma",
    "utmaldg", "utmastg" (off by default: disassembling every kernel doubles the time).
    Fresh process because triton.language's own @jit helpers (tl.max, tl.sum, ...) are built for
    either the interpreter or the compiler when triton is imported: once the interpreter has run
    here, the real front end fails on them.
    """
    records = []
    for label, source, inputs in jobs:
        path = tmp_path / f"sm90_{label}.py"
        path.write_text(source)
        records.append((label, str(path), [t.cpu() if isinstance(t, torch.Tensor) else t for t in inputs]))
    torch.save(records, tmp_path / "jobs.pt")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")  # a cache hit would skip the front end
    command = [sys.executable, __file__, str(tmp_path / "jobs.pt"), str(tmp_path / "compiled.json")]
    result = subprocess.run(command + (["--machine-code"] if machine_code else []), env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"sm_90 compilation failed:\n{result.stdout}\n{result.stderr[-3000:]}"
    return json.loads((tmp_path / "compiled.json").read_text())


def _signature(kernel, args, kwargs):
    """Triton's signature, constexprs and attributes for one launch, as a real launch makes them."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bound = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr or value is None or (type(value) is int and value == 1):
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, TensorDescriptor):
            block = ",".join(str(d) for d in value.block_shape)
            signature[param.name] = f"tensordesc<{_TRITON_TYPE[value.base.dtype]}[{block}]>"
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPE[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _compile_launches(path: str, inputs, machine_code: bool) -> dict:
    """Import the candidate, record every launch `run(*inputs)` makes, compile each for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    launches = []

    class Recorder:  # stands in for a kernel: kernel[grid](*args) records the launch
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.kernel, args, kwargs))

    if hasattr(module, "PDL"):  # compile what an sm_90 GPU runs: programmatic dependent launch on
        module.PDL, module.PDL_LAUNCH = True, {"launch_pdl": True}
    for name, value in list(vars(module).items()):
        if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
            setattr(module, name, Recorder(name, value))
    module.run(*inputs)
    results = {}
    for name, kernel, args, kwargs in launches:
        options = {"num_warps": kwargs.pop("num_warps"), "num_stages": kwargs.pop("num_stages", 3)}
        pdl_launch = kwargs.pop("launch_pdl", False)
        signature, constexprs, attrs = _signature(kernel, args, kwargs)
        compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm.get("cubin"), f"{name}: ptxas produced no cubin"
        ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
        results[name] = {
            "launches": results.get(name, {}).get("launches", 0) + 1,
            "wgmma": "warp_group_dot" in ttgir,
            # cp.async (pointer loads) or the copy engine, several stages deep
            "pipelined": "async_copy_global_to_local" in ttgir or "async_tma_copy_global_to_local" in ttgir,
            "tma": "cp.async.bulk.tensor" in ptx,
            "warp_specialized": "ttg.warp_specialize" in ttgir,
            # launched with launch_pdl and waiting for the previous kernel before any access
            "pdl": bool(pdl_launch) and "griddepcontrol.wait" in ptx,
            # f16 -> bf16 conversions (fp8 tiles widened to bf16 go e4m3 -> f16 -> bf16)
            "f16_to_bf16": ptx.count("cvt.bf16.f16"),
            # L2 prefetches issued before that wait (the GEMV's weights, which no kernel writes)
            "prefetch_before_wait": 0 <= ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"),
            "shared": compiled.metadata.shared,
            **(_machine_code_facts(compiled.asm["cubin"]) if machine_code else {}),
        }
    return results


def kernel_source(module_source: str) -> str:
    """The CUDA C++ source a CUDA family's generated module holds (its SOURCE string)."""
    return re.search(r'SOURCE = r"""\n(.*?)"""', module_source, re.S).group(1)


def triton_cuobjdump() -> Path:
    """The cuobjdump that ships with Triton (it may not run on this machine)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _machine_code_facts(cubin: bytes) -> dict:
    """Registers, spills and tensor-core instructions of a cubin, from the cuobjdump that ships
    with Triton (empty when it cannot run here)."""
    tool = triton_cuobjdump()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return {}
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "spill_instructions": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
        # byte-wide shared-memory loads in loops: an 8-bit tile gathered into a dot operand
        # element by element, every iteration
        "loop_byte_shared_loads": len(re.findall(r"\bLDS\.[US]8\b", "\n".join(_loop_bodies(sass)))),
        "loop_instructions": sum(len(body.splitlines()) for body in _loop_bodies(sass)),
        "hgmma": len(re.findall(r"\bHGMMA\b", sass)),
        "utmaldg": len(re.findall(r"\bUTMALDG\b", sass)),
        "utmastg": len(re.findall(r"\bUTMASTG\b", sass)),
    }


def _loop_bodies(sass: str) -> list[str]:
    """The SASS lines of each loop: from a backward branch's target to the branch."""
    lines = [(int(m.group(1), 16), line) for line in sass.splitlines()
             if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s", line))]
    bodies = []
    for address, line in lines:
        branch = re.search(r"\bBRA\s+0x([0-9a-f]+)", line)
        if branch and int(branch.group(1), 16) < address:
            bodies.append("\n".join(text for at, text in lines if int(branch.group(1), 16) <= at <= address))
    return bodies


def _compile_worker(jobs_file: str, results_file: str, *flags: str) -> int:
    """`python template_helpers.py JOBS RESULTS [--machine-code]`: compile every job, print one
    line per failure."""
    results, failures = {}, 0
    for label, path, inputs in torch.load(jobs_file):
        try:
            results[label] = _compile_launches(path, inputs, "--machine-code" in flags)
        except Exception as error:  # report every job, not just the first
            failures += 1
            print(f"{label}: {type(error).__name__}: {error}")
    Path(results_file).write_text(json.dumps(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_compile_worker(*sys.argv[1:]))


def assert_gemv_points_compile(family, cases: dict, make_inputs, tmp_path, target) -> None:
    """Compile every (region, points) of `cases` (name -> (region, [params])) for sm_90 and assert
    what a GEMV point must be there: one launch (split-K meets in it), pipelined weight loads, PDL,
    shared memory within the family's estimate, no spills (where cuobjdump runs)."""
    jobs, expected = [], {}
    for name, (region, points) in cases.items():
        for i, params in enumerate(points):
            assert family.check(region, params, target) is None, (name, params, family.check(region, params, target))
            jobs.append((f"{name}_{i}", family.render(region, params), make_inputs(region)))
            expected[f"{name}_{i}"] = (region, params)
    compiled = compile_for_hopper(jobs, tmp_path, machine_code=True)
    for label, (region, params) in expected.items():
        # one launch, split or not (NORM_FIRST: the row kernel before it)
        assert set(compiled[label]) == {"_gemv_kernel"} | ({"_rms_rows_kernel"} if params.get("NORM_FIRST") else set()), label
        if params.get("NORM_FIRST"):
            rows = compiled[label]["_rms_rows_kernel"]
            assert rows["launches"] == 1 and rows["pdl"], label
        kernel = compiled[label]["_gemv_kernel"]
        assert kernel["launches"] == 1 and kernel["pipelined"], f"{label}: weight loads not pipelined ({params})"
        # as conftest's compile_for_sm90 asserts for every template: launched with PDL, waiting first
        assert kernel["pdl"], f"{label}: launched without programmatic dependent launch"
        if not params.get("STREAM_K"):  # stream-K's ranges are known only in its loop: no prefetch
            assert kernel["prefetch_before_wait"], f"{label}: no weight prefetch ahead of the PDL wait"
        assert kernel["shared"] <= family._gemv_smem(region, params), f"{label}: check() underestimates shared memory"
        if kernel.get("spill_instructions") is not None:  # the SASS, where cuobjdump runs
            assert kernel["spill_instructions"] == 0, f"{label}: spills ({kernel['registers']} registers)"


def lay_out_in_pages(caches, counts, num_pages: int, page_size: int, generator):
    """The sequences' caches [B, Hkv, max_pages * P, D] as pages of one shuffled pool each:
    sequence b's first counts[b] pages are drawn in turn with the others' (round-robin, so the
    sequences interleave) from a permutation of the pool; free pages hold NaN, so a kernel that
    reads a page the table does not name poisons its output. Returns (pools, page_table int32).
    Per-token scales [B, Hkv, max_pages * P] among `caches` become pools [N, Hkv, P] paged alike."""
    batch, kv_heads, length = caches[0].shape[:3]
    pools = [torch.full((num_pages, kv_heads, page_size, *c.shape[3:]), float("nan")).to(c.dtype) for c in caches]
    order = torch.randperm(num_pages, generator=generator).tolist()
    table = torch.zeros(batch, length // page_size, dtype=torch.int32)
    for i in range(max(counts)):
        for b in range(batch):
            if i < counts[b]:
                page = order.pop()
                table[b, i] = page
                for cache, pages in zip(caches, pools):
                    pages[page] = cache[b, :, i * page_size:(i + 1) * page_size]
    return pools, table
