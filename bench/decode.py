"""Per-token decode latency of a Llama-3-8B-shaped model: eager, torch.compile, coopt, and the
bandwidth floor, in one run on one GPU.

    python bench/decode.py                           # 8 layers, the three cases of issue 3
    python bench/decode.py --layers 32 --cases 1:2048:4096 --out decode.json
    python bench/decode.py --cases 1:2048:4096 --prefill 0     # decode only, no prompt timing
    python bench/decode.py --cases "" --prefill 2048           # the prompt only
    python bench/decode.py --model-file examples/transformers_llama/model.py --prefill 0
                                                     # transformers' own Llama (needs transformers)

A case is batch:position:cache_length. Each variant runs the same model file
(examples/llama/model.py, bf16, random weights, the cache filled up to the position), one
decode step (one token per sequence), timed with triton.testing.do_bench (median). coopt's
build is replayed as a CUDA graph (coopt.runtime.cuda_graph.GraphedStep). The floor is the
bytes a step must read — all weights once (of the embedding table only the rows looked up) plus
the valid K/V of every layer — over the copy bandwidth: on an H200 the 4.2 TB/s issue 3's
targets were set with (this run's measured copy is printed beside it), on any other GPU this
run's own measurement (a 1 GiB device-to-device copy, bytes read plus written: ~3.0 TB/s on an
H100, where 4.2 would put the floor 1.4x too low).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bandwidth import H200_COPY_BYTES_PER_S, floor_bandwidth, measure_copy_bandwidth
from progress import build_progress

ROOT = Path(__file__).resolve().parents[1]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model-file", type=Path, default=ROOT / "examples" / "llama" / "model.py",
                        help="a decode-step model file taking the COOPT_LLAMA_* knobs: the project's Llama "
                             "(default) or examples/transformers_llama/model.py (transformers' LlamaForCausalLM; "
                             "decode cases only)")
    parser.add_argument("--cases", default="1:2048:4096,1:32768:32832,32:2048:4096")
    parser.add_argument("--modes", default="eager,max-autotune-no-cudagraphs,reduce-overhead,coopt,coopt-fp8",
                        help="coopt-fp8: the build with --kv-cache fp8 (issue 4), against its own fp8 floor; "
                             "coopt-unfolded: the default pipeline without fuse-kv-write-attention (kv_write a kernel of "
                             "its own); coopt-fp8-values: fp8-kv-cache{values-only} (V in fp8, K in bf16); "
                             "coopt-rownorms: the default without fuse-norm-statistics (each batched norm a row kernel); "
                             "coopt-normstats32: its sums over 32-column chunks (BLOCK_N 32 allowed in the o / down GEMVs); "
                             "coopt-fp8-unfolded / coopt-fp8-values-unfolded: those fp8 builds without "
                             "fuse-kv-write-attention; coopt-fp8-recent: --kv-cache fp8-recent (the newest 4 keys "
                             "unrounded, from rings beside the caches)")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--build-dir", type=Path, default=None, help="keep each coopt build in DIR/<case>")
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep each build's weights.pt once it is timed (default: removed, the rest of the "
                             "build kept; 5.5 GB a build at 8 layers, 16 GB at 32 fill a device's disk in a few "
                             "cases: session 22)")
    parser.add_argument("--agreement-steps", type=int, default=64,
                        help="teacher-forced decode steps of the coopt build vs an fp32 eager copy (0 skips)")
    parser.add_argument("--prefill", type=int, default=2048,
                        help="also time a prompt of this many tokens (batch 1, cache 4096): tokens/s; 0 skips")
    return parser.parse_args()


def load_case(layers: int, batch: int, pos: int, cache: int, model_file: Path = ROOT / "examples" / "llama" / "model.py"):
    os.environ.update(
        COOPT_LLAMA_PRESET="llama-3-8b", COOPT_LLAMA_LAYERS=str(layers), COOPT_LLAMA_BATCH=str(batch),
        COOPT_LLAMA_POS=str(pos), COOPT_LLAMA_MAX_SEQ=str(cache), COOPT_EXAMPLE_DTYPE="bfloat16",
    )
    import torch

    from coopt.compile import moved_in_place
    from coopt.frontend.model_file import load_model_file

    loaded = load_model_file(model_file)
    # in place: transformers' wrapper also holds its caches on plain objects (.cuda() would leave those on the CPU)
    return moved_in_place(loaded.model, torch.device("cuda")), tuple(x.cuda() for x in loaded.example_inputs)


def measure(row: dict, mode: str, fn, expected, setup_s: float, *, warmup: int, rep: int) -> None:
    """Check `fn()` against `expected`, then time it (median ms) into row[...][mode]."""
    import torch
    from triton.testing import do_bench

    with torch.no_grad():
        row.setdefault("max_abs_err", {})[mode] = float((fn().float() - expected).abs().max())
        row["ms"][mode] = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    row["setup_s"][mode] = setup_s


def compile_model(model, mode: str, inputs, *, calls: int):
    """torch.compile(model, mode) and seconds to its first `calls` calls (compilation; CUDA
    graph recording for reduce-overhead, which needs a few)."""
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode)
    start = time.monotonic()
    with torch.no_grad():
        for _ in range(calls):
            compiled(*inputs)
    return compiled, time.monotonic() - start


def run_prefill(args, save=lambda row: None) -> dict:
    """Prefill throughput: one call over a `args.prefill`-token prompt at positions 0..T-1 (the
    Llama example's prefill entry point, dynamic in T), eager vs torch.compile vs coopt; the
    coopt build here is the prefill entry alone (the same compile path as out/entries/prefill).
    `save(row)` after every mode (a call cut inside max-autotune's autotuning keeps the others)."""
    import torch

    import coopt
    from coopt.frontend.model_file import load_model_file

    length = args.prefill
    os.environ.update(
        COOPT_LLAMA_PRESET="llama-3-8b", COOPT_LLAMA_LAYERS=str(args.layers), COOPT_LLAMA_BATCH="1",
        COOPT_LLAMA_POS="0", COOPT_LLAMA_MAX_SEQ=str(max(4096, length)), COOPT_EXAMPLE_DTYPE="bfloat16",
        COOPT_LLAMA_PREFILL=str(length),
    )
    loaded = load_model_file(ROOT / "examples" / "llama" / "model.py")
    model = loaded.model.cuda()
    inputs, dynamic = loaded.entry_points["prefill"]
    inputs = tuple(x.cuda() for x in inputs)
    row = {"prefill": length, "layers": args.layers, "ms": {}, "tokens_per_s": {}, "setup_s": {}}
    print(f"prefill of {length} tokens (batch 1)", flush=True)
    with torch.no_grad():
        expected = model(*inputs).float()

    def record(mode, fn, setup_s):
        measure(row, mode, fn, expected, setup_s, warmup=25, rep=200)
        row["tokens_per_s"][mode] = length / (row["ms"][mode] * 1e-3)
        print(f"  {mode:28s} {row['ms'][mode]:8.3f} ms  {row['tokens_per_s'][mode]:10.0f} tokens/s"
              f"  max abs err {row['max_abs_err'][mode]:.3g}  setup {setup_s:.0f}s", flush=True)
        save(row)

    modes = args.modes.split(",")
    if "eager" in modes:
        record("eager", lambda: model(*inputs), 0.0)
    if "reduce-overhead" in modes:  # before the coopt build: its setup is short
        compiled, setup_s = compile_model(model, "reduce-overhead", inputs, calls=3)
        record("compile reduce-overhead", lambda: compiled(*inputs), setup_s)
    if "coopt" in modes:
        out = (args.build_dir or Path(tempfile.mkdtemp(prefix="coopt-prefill-"))) / f"prefill-{length}"
        start = time.monotonic()
        coopt.Pipeline(top_k=args.top_k).build(model, inputs, out, dynamic_shapes=dynamic, force=True,
                                               progress=build_progress())
        built = coopt.load(out)
        record("coopt", lambda: built(*inputs), time.monotonic() - start)
    if "max-autotune-no-cudagraphs" in modes:  # last: its autotuning is the slowest setup
        compiled, setup_s = compile_model(model, "max-autotune-no-cudagraphs", inputs, calls=1)
        record("compile max-autotune-no-cudagraphs", lambda: compiled(*inputs), setup_s)
    return row


def floor_ms(model, batch: int, pos: int, kv_element_bytes: int | None = None, values_only: bool = False,
             bandwidth: float = H200_COPY_BYTES_PER_S) -> float:
    """Bytes one decode step must read over `bandwidth` (bytes/s): every weight once, except
    embedding tables (only the `batch` looked-up rows), plus the valid K/V of every layer (at
    `kv_element_bytes` per element when given: 1 for an fp8 cache; with `values_only` the keys
    at their own size)."""
    import torch

    seen: set[int] = set()
    weights = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:  # a tied table read by the output projection counts once, fully
                continue
            if isinstance(module, torch.nn.Embedding) and not _also_used_elsewhere(model, module, param):
                weights += batch * param.shape[1] * param.element_size()
            else:
                weights += param.numel() * param.element_size()
            seen.add(id(param))
    kv = 0
    for name, buffer in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        keys = leaf == "k_cache" or leaf.startswith("key_cache_")  # the project's, transformers' StaticCache
        if keys or leaf == "v_cache" or leaf.startswith("value_cache_"):  # [B, Hkv, S_max, D]: the valid part is read
            _, hkv, _, d = buffer.shape
            own = values_only and keys
            kv += batch * hkv * (pos + 1) * d * ((None if own else kv_element_bytes) or buffer.element_size())
    return (weights + kv) / bandwidth * 1e3


def _also_used_elsewhere(model, embedding, param) -> bool:
    """Whether another module (a tied output projection) holds the same tensor."""
    return any(p is param for m in model.modules() if m is not embedding for p in m.parameters(recurse=False))


def build_summary(out: Path) -> dict:
    """What a row keeps of out/build.json: the build's seconds, by step, what its end-to-end
    check judged against (a 32-layer b32 build streams its float64 reference: session 10), the
    ops it left to PyTorch between its kernels (launches a step beside coopt's), and the
    candidates that failed verification (out/verify/results.json: "region candidate" each). A
    failing candidate costs no correctness, the build falls back, but it may have been the
    fastest: session 18 found an fp8 decode attention failing on the H200 this way, unseen. Also
    each leading region's selection (out/selection.json; regions that share a leader's candidates
    are left out): the candidate, its knobs, its measured latency and the reference's, so a row
    says which kernels it timed after the build directory is gone (session 19 lost them)."""
    record = json.loads((out / "build.json").read_text())
    check = record.get("end_to_end") or {}
    results_file = out / "verify" / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    failed = [f"{region} {label}" for region, candidates in sorted(results.items())
              for label, result in sorted(candidates.items()) if not result.get("ok")]
    return {"seconds": record.get("seconds"), "step_seconds": record.get("step_seconds"),
            "reference_precision": check.get("reference_precision"), "check_max_abs_err": check.get("max_abs_err"),
            "unfused_ops": record.get("unfused_ops"), "launch": record.get("launch"), "failed_verification": failed,
            "warnings": record.get("warnings", []), "selected": selections(out / "selection.json")}


def selections(path: Path) -> dict:
    """{region: {"label", "params", "ms", "reference_ms"}} of each region with candidates of its
    own in a build's selection.json ({} where the file is missing)."""
    if not path.exists():
        return {}
    chosen = {}
    for name, region in json.loads(path.read_text())["regions"].items():
        if region.get("same_as"):
            continue
        by_label = {c["label"]: c for c in region["candidates"]}
        pick, reference = by_label.get(region["selected"], {}), by_label.get("reference", {})
        chosen[name] = {"label": region["selected"], "params": pick.get("params", {}),
                        "ms": pick.get("latency_ms"), "reference_ms": reference.get("latency_ms")}
    return chosen


def run_case(case: str, args, save=lambda row: None) -> dict:
    """One case's row; `save(row)` after every variant (a call cut by its time limit keeps them).
    max-autotune-no-cudagraphs runs last: its autotuning is the slowest setup."""
    import gc

    import torch

    import coopt
    from coopt.errors import CooptError
    from coopt.runtime.cuda_graph import GraphedStep

    batch, pos, cache = (int(v) for v in case.split(":"))
    model, inputs = load_case(args.layers, batch, pos, cache, args.model_file)
    row = {"case": case, "batch": batch, "pos": pos, "cache": cache, "layers": args.layers,
           "floor_ms": floor_ms(model, batch, pos, bandwidth=args.floor_bandwidth), "ms": {}, "setup_s": {}}
    print(f"case b{batch} pos {pos} (cache {cache}): floor {row['floor_ms']:.3f} ms", flush=True)
    with torch.no_grad():
        expected = model(*inputs).float()

    def record(mode, fn, setup_s):
        measure(row, mode, fn, expected, setup_s, warmup=50, rep=300)
        print(f"  {mode:28s} {row['ms'][mode]:8.3f} ms  ({row['floor_ms'] / row['ms'][mode]:.0%} of floor)"
              f"  max abs err {row['max_abs_err'][mode]:.3g}  setup {setup_s:.0f}s", flush=True)
        save(row)

    def compiled_variant(mode):
        compiled, setup_s = compile_model(model, mode, inputs, calls=3)
        record(f"compile {mode}", lambda: compiled(*inputs), setup_s)
        del compiled
        torch._dynamo.reset()
        gc.collect()  # reduce-overhead's graph pool goes with its last reference: the builds need the memory
        torch.cuda.empty_cache()

    modes = args.modes.split(",")
    if "eager" in modes:
        record("eager", lambda: model(*inputs), 0.0)
    if "reduce-overhead" in modes:
        compiled_variant("reduce-overhead")
    from coopt.accuracy.builds import fp8_kv_pipeline
    from coopt.passes.registry import DEFAULT_PIPELINE, ROW_NORMS_PIPELINE, UNFOLDED_KV_WRITE_PIPELINE

    for mode, kv_cache, pipeline in (("coopt", "none", DEFAULT_PIPELINE), ("coopt-fp8", "fp8", DEFAULT_PIPELINE),
                                     ("coopt-fp8-recent", "fp8-recent", DEFAULT_PIPELINE),
                                     ("coopt-unfolded", "none", UNFOLDED_KV_WRITE_PIPELINE),
                                     ("coopt-rownorms", "none", ROW_NORMS_PIPELINE),
                                     ("coopt-normstats32", "none",
                                      DEFAULT_PIPELINE.replace("fuse-norm-statistics", "fuse-norm-statistics{chunk=32}")),
                                     ("coopt-fp8-values", "none", fp8_kv_pipeline("per-head", values_only=True)),
                                     ("coopt-fp8-unfolded", "fp8", UNFOLDED_KV_WRITE_PIPELINE),
                                     ("coopt-fp8-values-unfolded", "none",
                                      fp8_kv_pipeline("per-head", UNFOLDED_KV_WRITE_PIPELINE, values_only=True))):
        if mode not in modes:
            continue
        suffix = mode[len("coopt"):]
        out = (args.build_dir or Path(tempfile.mkdtemp(prefix="coopt-decode-"))) / f"b{batch}-pos{pos}{suffix}"
        start = time.monotonic()
        try:
            coopt.Pipeline(pipeline, top_k=args.top_k, kv_cache=kv_cache).build(model, inputs, out, force=True,
                                                                                progress=build_progress())
        except CooptError as error:  # e.g. the GPU's memory (exit 11): the other modes still run
            print(f"  {mode}: build failed (exit {error.exit_code}): {error.message}", flush=True)
            row.setdefault("build_errors", {})[mode] = error.message
            save(row)
            gc.collect()  # what the failed build loaded goes back to the device for the next mode's workers
            torch.cuda.empty_cache()
            continue
        built = coopt.load(out)
        step = GraphedStep(built, inputs, check=False)  # the bench times the replay, not the value check
        record(mode, lambda: step(*inputs), time.monotonic() - start)
        row[f"{mode}_report"] = str(out / "report.md")
        row[f"{mode}_build"] = build_summary(out)
        if row[f"{mode}_build"]["failed_verification"]:
            print(f"  {mode}: candidates that failed verification (the build fell back; repros in "
                  f"{out / 'verify' / 'repro'}): " + ", ".join(row[f"{mode}_build"]["failed_verification"]), flush=True)
        for warning in row[f"{mode}_build"]["warnings"]:  # fallbacks, the check's reference: the row's caveats
            print(f"  {mode}: warning: {warning}", flush=True)
        for name, chosen in row[f"{mode}_build"]["selected"].items():  # which attention form won (split, meeting)
            if "attention" in name and chosen["ms"] is not None:
                reference = f" (reference {chosen['reference_ms'] * 1e3:.2f})" if chosen["reference_ms"] else ""
                print(f"  {mode}: {name} {chosen['label']} {chosen['params']} {chosen['ms'] * 1e3:.2f} us{reference}",
                      flush=True)
        launch = row[f"{mode}_build"]["launch"]
        if launch:  # the build's own PDL choice, from its replayed step (coopt/tune/launch.py)
            print(f"  {mode}: launched with PDL for {launch['pdl'] or 'nothing'} (build's replays, ms: "
                  + ", ".join(f"{k} {v:.4f}" for k, v in launch["step_ms"].items()) + ")", flush=True)
            refined = launch.get("refined") or {}
            if refined.get("step_ms"):  # then module by module: each module switched the other way
                print(f"  {mode}: module by module, kept {refined['chosen']} (regions {launch.get('pdl_regions') or {}}; "
                      "ms: " + ", ".join(f"{k} {v:.4f}" for k, v in refined["step_ms"].items()) + ")", flush=True)
        if kv_cache in ("fp8", "fp8-recent"):  # its own floor: the cache read at one byte per element (+ scales)
            row["fp8_floor_ms"] = floor_ms(model, batch, pos, kv_element_bytes=1, bandwidth=args.floor_bandwidth)
            print(f"  {mode}: {row['fp8_floor_ms'] / row['ms'][mode]:.0%} of its fp8 floor "
                  f"({row['fp8_floor_ms']:.3f} ms)", flush=True)
        if mode.startswith("coopt-fp8-values"):  # its own floor: bf16 keys, fp8 values
            row["fp8_values_floor_ms"] = floor_ms(model, batch, pos, kv_element_bytes=1, values_only=True,
                                                  bandwidth=args.floor_bandwidth)
            print(f"  {mode}: {row['fp8_values_floor_ms'] / row['ms'][mode]:.0%} of its floor "
                  f"({row['fp8_values_floor_ms']:.3f} ms)", flush=True)
        if args.agreement_steps:  # accuracy of the build: logits and top-1 vs eager in fp32
            import copy

            from coopt.compile import moved_in_place
            from coopt.verify.decode_agreement import decode_agreement

            steps = min(args.agreement_steps, cache - pos)
            try:
                reference = moved_in_place(copy.deepcopy(model), dtype=torch.float32)  # (aliases kept: transformers)
                row.setdefault("agreement", {})[mode] = decode_agreement(built, reference, inputs[0], pos, steps).to_json()
            except torch.OutOfMemoryError:  # 32 layers at b32 in fp32 (66 GB) beside both models: not on an H100
                reference = None
                torch.cuda.empty_cache()
                print(f"  {mode} vs eager fp32: skipped, its fp32 copy does not fit in the GPU's memory", flush=True)
            else:
                agreement = row["agreement"][mode]
                print(f"  {mode} vs eager fp32 over {steps} steps: max abs err {agreement['max_abs_err']:.3g}, "
                      f"top-1 agreement {agreement['top1_agreement']:.1%}", flush=True)
            del reference
        del step, built
        torch.cuda.empty_cache()
        if not args.keep_weights:
            (out / "weights.pt").unlink(missing_ok=True)
        save(row)
    if "max-autotune-no-cudagraphs" in modes:
        compiled_variant("max-autotune-no-cudagraphs")
    return row


def main():
    args = parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("bench/decode.py needs a CUDA GPU")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "model_file": os.path.relpath(args.model_file.resolve(), ROOT)}
    copy = measure_copy_bandwidth()
    args.floor_bandwidth, env["floor_bandwidth"] = floor_bandwidth(env["gpu"], copy)
    env.update(copy_tb_s=round(copy / 1e12, 3), floor_tb_s=round(args.floor_bandwidth / 1e12, 3))
    print(json.dumps(env), flush=True)
    rows = []

    def save(row):
        if args.out:
            args.out.write_text(json.dumps({"environment": env, "rows": [*rows, row]}, indent=2))

    for case in filter(None, args.cases.split(",")):  # --cases "" with --prefill N: the prompt alone
        rows.append(run_case(case, args, save))
        if args.out:
            args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))

    modes = sorted({m for r in rows for m in r["ms"]})
    print("\n| case | floor ms | " + " | ".join(f"{m} ms" for m in modes) + " | coopt / floor |")
    print("|" + " --- |" * (len(modes) + 3))
    for r in rows:
        cells = [f"{r['ms'][m]:.3f}" if m in r["ms"] else "—" for m in modes]
        frac = f"{r['ms']['coopt'] / r['floor_ms']:.2f}x" if "coopt" in r["ms"] else "—"
        if "coopt-fp8" in r["ms"]:
            frac += f" (fp8: {r['ms']['coopt-fp8'] / r['fp8_floor_ms']:.2f}x of {r['fp8_floor_ms']:.3f})"
        print(f"| b{r['batch']} pos {r['pos']} | {r['floor_ms']:.3f} | " + " | ".join(cells) + f" | {frac} |")
    if args.prefill and args.model_file.resolve() != (ROOT / "examples" / "llama" / "model.py").resolve():
        print(f"\nprefill skipped: it times examples/llama/model.py's prefill entry point, not {args.model_file}")
    elif args.prefill:
        def save_prefill(prefill):
            if args.out:
                args.out.write_text(json.dumps({"environment": env, "rows": rows, "prefill": prefill}, indent=2))

        prefill = run_prefill(args, save_prefill)
        save_prefill(prefill)
        print(f"\n| prefill {prefill['prefill']} tokens | " + " | ".join(prefill["ms"]) + " |")
        print("|" + " --- |" * (len(prefill["ms"]) + 1))
        print("| ms | " + " | ".join(f"{v:.2f}" for v in prefill["ms"].values()) + " |")
        print("| tokens/s | " + " | ".join(f"{v:,.0f}" for v in prefill["tokens_per_s"].values()) + " |")


if __name__ == "__main__":
    main()
