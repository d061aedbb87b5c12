"""out/report.md: what a person wants to know about a build, in the order they ask it.

Rendered from the files of the build directory alone (build.json + selection.json), so
`coopt tune` can render it again after measuring on the GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE = "reference"


def write_build_record(out: Path, config, model_path, result) -> None:
    """out/build.json: what the report needs beyond selection.json."""
    record = {
        "model": Path(model_path).name if model_path else "model",
        "target": config.target.name,
        "pipeline": config.pipeline_text,
        "advisor": config.advisor_name,
        "top_k": config.top_k,
        "verify_profile": config.verify_profile,
        "cuda_graphs": result.cuda_graphs,
        "seconds": round(result.seconds, 1),
        "step_seconds": result.step_seconds,
        "counters": dict(sorted(result.counters.items())),
        "fallback_ops": result.fallback_ops,
        "unfused_ops": result.unfused_ops,
        "end_to_end": result.e2e,
        "warnings": result.warnings,
    }
    if result.accuracy is not None:  # a lossy pass ran: its measured cost (docs/contracts.md)
        record["accuracy"] = result.accuracy
    if result.launch is not None:  # the replayed step timed with and without PDL (tune/launch.py)
        record["launch"] = result.launch
    (out / "build.json").write_text(json.dumps(record, indent=2, sort_keys=True))


def record_entry_points(out: Path, result) -> None:
    """The main build's build.json and report name the extra entry points built beside it."""
    path = Path(out) / "build.json"
    record = json.loads(path.read_text())
    record["entries"] = {
        name: {"dir": f"entries/{name}", "regions": len(entry.regions),
               "kernels": sum(r.selected != REFERENCE for r in entry.regions), "seconds": round(entry.seconds, 1)}
        for name, entry in result.entries.items()
    }
    path.write_text(json.dumps(record, indent=2, sort_keys=True))
    write_report(out)


def _launch_line(launch: dict) -> str:
    """The replayed step's launch choice, e.g. '- launch: PDL for gemv kernels, measured (the
    replayed step 1.7655 ms; without PDL 1.7802)'."""
    from coopt.tune.launch import switch_set
    from coopt.tune.pdl_ready import SWAP_BUDGET_MS

    switched_with = {"+ready": f" with PDL-ready kernels re-selected (within {SWAP_BUDGET_MS * 1e3:g} µs)",
                     "+allready": " with every PDL-ready kernel re-selected"}

    def option(label: str) -> str:  # a label tune/launch.py timed
        kinds, suffix = label.partition("+")[0], switch_set(label)
        what = "without PDL" if kinds == "none" else f"PDL for {kinds.replace(',', ', ')}"
        return what + switched_with.get(suffix, f" with switch set {suffix}" if suffix else "")

    times = launch["step_ms"]
    chosen = _chosen_label(launch)
    others = ", ".join(f"{option(k)} {ms:.4f}" for k, ms in times.items() if k != chosen)
    what = option(chosen) + (" kernels" if chosen != "none" and not switch_set(chosen) else "")
    switched = launch.get("reselected") or {}
    if switched:
        what += f" ({len(switched)} regions switched: see their reasons)"
    line = f"- launch: {what}, measured (the replayed step {times[chosen]:.4f} ms; {others or 'no other option applied'})"
    refined = launch.get("refined") or {}
    if refined.get("chosen", "base") != "base":  # tune/launch.py refine_modules: some modules launched the other way
        regions = launch.get("pdl_regions") or {}
        on, off = ([r for r, pdl in regions.items() if pdl is flag] for flag in (True, False))
        parts = [f"{how} for {len(names)} regions ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                 for how, names in (("with PDL", on), ("without PDL", off)) if names]
        line += (f"; then, module by module, {' and '.join(parts)}: the replayed step {_replayed_ms(launch):.4f} ms "
                 f"(unswitched {refined['step_ms']['base']:.4f})")
    return line


def _chosen_label(launch: dict) -> str:
    """The label tune/launch.py timed the chosen launch under (builds before session 36 had none)."""
    return launch.get("label") or ",".join(launch["pdl"]) or "none"


def _replayed_ms(launch: dict | None) -> float | None:
    """The replayed step's time under the launch the build chose, refined module by module where it
    was (None where it timed none)."""
    if not launch:
        return None
    refined = launch.get("refined") or {}
    if refined.get("chosen", "base") != "base":
        return refined["step_ms"][refined["chosen"]]
    return launch["step_ms"].get(_chosen_label(launch))


def _step_times(steps: dict) -> str:
    if not steps:
        return ""
    return " (" + ", ".join(f"{step} {seconds:.1f} s" for step, seconds in steps.items()) + ")"


def _shape(spec: dict) -> str:
    return "x".join(str(d) for d in spec["shape"]) + f" {spec['dtype']}"


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "—"


def _verdict(candidate: dict) -> str:
    if candidate["family"] == REFERENCE:
        return "original ops"
    if candidate["verified"]:
        return f"pass ({candidate['verify'].get('examples', '?')} examples)"
    return "FAIL: " + str(candidate["verify"].get("failure", "")).replace("|", "\\|")


def _latency(candidate: dict) -> str:
    ms = candidate.get("latency_ms")
    return f"{ms:.4f} ms" if ms is not None else "unmeasured"


def _versus_inductor(region: dict) -> list[str]:
    """The same ops through torch.compile, measured in the same worker: say where we lose."""
    inductor = region.get("inductor_ms")
    chosen = next((c for c in region["candidates"] if c["label"] == region["selected"]), None)
    if inductor is None or chosen is None or chosen.get("latency_ms") is None:
        return []
    ours = chosen["latency_ms"]
    if ours <= inductor:
        return [f"torch.compile on the same ops: {inductor:.4f} ms; the selection is {inductor / ours:.2f}x faster", ""]
    fastest_template = min((c["latency_ms"] for c in region["candidates"]
                            if c["family"] != REFERENCE and c.get("latency_ms") is not None), default=None)
    why = ("no verified template candidate was measured" if fastest_template is None else
           f"the best verified template took {fastest_template:.4f} ms and the reference {ours:.4f} ms; "
           "inductor's own kernel for these ops is faster than both")
    return [f"**loses to torch.compile**: {inductor:.4f} ms vs {ours:.4f} ms ({ours / inductor:.2f}x slower): {why}", ""]


def _region_lines(name: str, region: dict) -> list[str]:
    from coopt.ir.region import RegionSummary

    summary = RegionSummary.from_json(region["summary"])
    if region.get("same_as"):
        return [f"### {name} ({region['family']})", "",
                f"identical to {region['same_as']} (same computation and shapes): its candidates, checks and "
                f"timings serve here; **selected: {region['selected']}**", ""]
    lines = [
        f"### {name} ({region['family']})",
        "",
        f"inputs: {', '.join(_shape(i) for i in region['summary']['inputs'])} → outputs: "
        f"{', '.join(_shape(o) for o in region['summary']['outputs'])}; "
        f"{summary.bytes_moved() / 1e6:.3f} MB moved, {summary.flops() / 1e6:.3f} MFLOP at the example shapes",
        "",
        f"**selected: {region['selected']}** — {region.get('reason', '')}",
        "",
        *_versus_inductor(region),
        "| candidate | family | params | verification | latency |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in region["candidates"]:
        lines.append(f"| {c['label']} | {c['family']} | {_params(c['params'])} | {_verdict(c)} | {_latency(c)} |")
    return lines + [""]


def _lossy_lines(accuracy: dict) -> list[str]:
    """The "Lossy transformations" section: which passes changed numerics, what they saved, and
    their measured cost against the original model."""
    lines = ["## Lossy transformations", "",
             f"This build changes numerics on purpose; measured against {accuracy.get('reference', 'the original model')}:", ""]
    for entry in accuracy["passes"]:
        knobs = ", ".join(f"{k}={v}" for k, v in entry["knobs"].items()) or "no knobs"
        lines.append(f"- pass `{entry['pass']}` ({knobs})")
    memory = accuracy.get("kv_cache_bytes")
    if memory:
        rings = any(entry["knobs"].get("exact-recent") for entry in accuracy["passes"])  # fp8-kv-cache's rings
        lines.append(f"- KV cache: {memory['before']:,} bytes → {memory['after']:,} bytes with scales"
                     f"{' and the newest rows’ rings' if rings else ''} "
                     f"({memory['saved']:,} bytes saved, {memory['saved'] / max(memory['before'], 1):.0%})")
    lines.append(f"- outputs on fresh inputs ({accuracy['trials']} trials): max abs err {accuracy['max_abs_err']:.3g}, "
                 f"max rel err {accuracy['max_rel_err']:.3g} (relative to the largest output magnitude)")
    if "top1_agreement" in accuracy:
        lines.append(f"- {accuracy['decode_steps']} teacher-forced decode steps: top-1 agreement "
                     f"{accuracy['top1_agreement']:.1%}, mean KL {accuracy['mean_kl']:.3g} nats, "
                     f"max abs logit err {accuracy['decode_max_abs_err']:.3g}")
    return lines + [""]


def write_report(out: Path) -> None:
    out = Path(out)
    build = json.loads((out / "build.json").read_text())
    selection = json.loads((out / "selection.json").read_text())
    regions = selection["regions"]
    measured = selection.get("measured", False)
    counters = build["counters"]
    lines = [f"# coopt build report: {build['model']}", ""]
    lines += [
        f"- target: **{build['target']}**; pipeline: `{build['pipeline']}`",
        f"- advisor: {build['advisor']} (top {build['top_k']} per family); verification profile: {build['verify_profile']}",
        "- latency: " + (("measured on the GPU" + (", replayed in CUDA graphs (GPU time, no launch cost)"
                                                    if build.get("cuda_graphs") else ", with launch cost (CUDA events)"))
                         if measured else
                          "unmeasured (no GPU): selection follows the advisor; run `coopt tune` on the target"),
        f"- build time: {build['seconds']:.1f} s" + _step_times(build.get("step_seconds", {})),
        "",
    ]
    if build.get("entries"):
        lines += ["Entry points built into this artifact beside `forward`, sharing its weights and state "
                  "(`coopt.load(out).entry_points[name]`):", ""]
        lines += [f"- **{name}**: {e['regions']} regions, {e['kernels']} on generated kernels, {e['seconds']:.1f} s; "
                  f"report: [{e['dir']}/report.md]({e['dir']}/report.md)" for name, e in build["entries"].items()]
        lines.append("")
    lines += [
        "## What was fused",
        "",
    ]
    fused = {k: v for k, v in counters.items() if k.startswith("fuse.")}
    raised = {k: v for k, v in counters.items() if k.startswith("raise.")}
    lines += [f"- {k.removeprefix('fuse.')}: {v}" for k, v in fused.items()] or ["- nothing"]
    lines += ["", "Patterns recognised: " + (", ".join(f"{k.removeprefix('raise.')} ×{v}" for k, v in raised.items()) or "none"), ""]
    # the exact rewrites before raising (cse-aten, simplify-aten, fold-constants: weights computed at build time)
    rewritten = {k: v for k, v in counters.items() if k.startswith(("cse.", "simplify.", "fold."))}
    if rewritten:
        lines += ["Rewritten before raising: " + ", ".join(f"{k} ×{v}" for k, v in rewritten.items()), ""]
    if counters.get("paged_kv.caches"):  # paged-kv: the caches became page pools
        scales = counters.get("paged_kv.scale_buffers", 0)  # per-token fp8 scales, paged with their caches
        lines += [f"Paged KV: paged {counters['paged_kv.caches']} caches into page pools"
                  + (f" (and their {scales} per-token scale buffers into scale pools)" if scales else "") + "; "
                  f"{counters.get('paged_kv.writes', 0)} writes and {counters.get('paged_kv.attention_reads', 0)} attention "
                  f"reads go through the page table (`page_table` input)"
                  + (f"; {counters['paged_kv.rings']} exact-recent rings became pools of ring slots, one a live "
                     "sequence (`ring_slots` input)" if counters.get("paged_kv.rings") else ""), ""]
    lines += ["## What fell back to PyTorch", ""]
    if build["fallback_ops"]:
        lines += ["ATen ops the importer does not know run unchanged through PyTorch:", ""]
        lines += [f"- `{name}` ×{n}" for name, n in sorted(build["fallback_ops"].items())]
    else:
        lines.append("- no unknown ATen ops")
    unfused = build.get("unfused_ops") or {}
    if unfused:  # known ops no region took: each launches a PyTorch kernel between coopt's
        n = sum(unfused.values())
        ops = f"{n} ops a call run" if n != 1 else "1 op a call runs"
        lines += ["", f"Outside every region, {ops} through PyTorch, each its own launch (views not counted):", ""]
        lines += [f"- `{name}` ×{n}" for name, n in unfused.items()]
    kept = {name: r for name, r in regions.items() if r["selected"] == REFERENCE}
    if kept:
        lines += ["", "Regions kept on the reference path (the original ops: cuBLAS, SDPA, ATen kernels):", ""]
        lines += [f"- {name}: {r.get('reason', '')}" for name, r in kept.items()]
    lines += ["", "## Regions", ""]
    for name, region in regions.items():
        lines += _region_lines(name, region)
    if build.get("accuracy"):
        lines += _lossy_lines(build["accuracy"])
    lines += ["## End to end", ""]
    e2e = build["end_to_end"]
    if e2e.get("lossy"):
        lines.append(f"- built model vs original on fresh inputs: measured, not held to the exact tolerance (lossy "
                     f"pipeline, see above): max abs err {e2e['max_abs_err']:.3g}, max rel err {e2e['max_rel_err']:.3g}")
    else:
        lines.append(f"- built model vs original on fresh inputs: {'pass' if e2e.get('ok') else 'FAIL'}"
                     f" (max abs err {e2e.get('max_abs_err', float('nan')):.3g})")
    if "speedup" in e2e:
        line = f"- latency at build time: eager {e2e['eager_ms']:.4f} ms, built {e2e['built_ms']:.4f} ms → {e2e['speedup']:.2f}x"
        if build.get("cuda_graphs"):  # events around Python calls: not what a replayed step costs
            line += " (each call launched from Python; a CUDA graph replays the built step without that cost"
            replayed = None if selection.get("launch_note") else _replayed_ms(build.get("launch"))
            line += f": {replayed:.4f} ms)" if replayed is not None else ")"
        lines.append(line)
        if e2e["speedup"] < 1.0 and build.get("cuda_graphs"):
            lines.append("- launched from Python the built model was slower than eager: each of its kernels costs a "
                         "Python launch (Triton's launcher), which is host time, not GPU time; `generate()` replays "
                         "the step as a CUDA graph without it (the replayed time above; "
                         "`coopt.runtime.cuda_graph.GraphedStep` for a loop of one's own)")
        elif e2e["speedup"] < 1.0:
            lines.append("- the built model was slower than eager end to end: the kernels are the same where regions kept the reference; the difference is the program's own overhead (input checks, pytree) or run-to-run spread")
    if selection.get("launch_note"):  # `coopt tune` re-selected after the build measured its launch
        lines.append(f"- launch: {selection['launch_note']}")
    elif build.get("launch"):
        lines.append(_launch_line(build["launch"]))
    if build["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in build["warnings"]]
    (out / "report.md").write_text("\n".join(lines) + "\n")
