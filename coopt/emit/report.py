"""out/report.md: what a person wants to know about a build, in the order they ask it."""

from __future__ import annotations

from pathlib import Path

from coopt.candidates import REFERENCE


def _shape(spec) -> str:
    return "x".join(str(d) for d in spec.shape) + f" {spec.dtype}"


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "—"


def _verdict(c) -> str:
    if c.family == REFERENCE:
        return "original ops"
    if c.verified:
        return f"pass ({c.verify.get('examples', '?')} examples)"
    return "FAIL: " + str(c.verify.get("failure", "")).replace("|", "\\|")


def _latency(c) -> str:
    return f"{c.latency_ms:.4f} ms" if c.latency_ms is not None else "unmeasured"


def write_report(out: Path, config, model_path, result) -> None:
    lines = [f"# coopt build report: {Path(model_path).name if model_path else 'model'}", ""]
    lines += [
        f"- target: **{config.target.name}**; pipeline: `{config.pipeline_text}`",
        f"- advisor: {config.advisor_name} (top {config.top_k} per family); verification profile: {config.verify_profile}",
        f"- latency: {'measured on this GPU' if result.measured else 'unmeasured (no GPU): selection follows the advisor; run `coopt tune` on the target'}",
        f"- build time: {result.seconds:.1f} s",
        "",
        "## What was fused",
        "",
    ]
    fused = {k: v for k, v in sorted(result.counters.items()) if k.startswith("fuse.")}
    raised = {k: v for k, v in sorted(result.counters.items()) if k.startswith("raise.")}
    lines += [f"- {k.removeprefix('fuse.')}: {v}" for k, v in fused.items()] or ["- nothing"]
    lines += ["", "Patterns recognised: " + (", ".join(f"{k.removeprefix('raise.')} ×{v}" for k, v in raised.items()) or "none"), ""]
    lines += ["## What fell back to PyTorch", ""]
    if result.fallback_ops:
        lines += ["ATen ops the importer does not know run unchanged through PyTorch:", ""]
        lines += [f"- `{name}` ×{n}" for name, n in sorted(result.fallback_ops.items())]
    else:
        lines.append("- no unknown ATen ops")
    kept = [r for r in result.regions if r.selected == REFERENCE]
    if kept:
        lines += ["", "Regions kept on the reference path (vendor kernels through PyTorch):", ""]
        lines += [f"- {r.summary.name}: {r.reason}" for r in kept]
    lines += ["", "## Regions", ""]
    for region in result.regions:
        s = region.summary
        lines += [
            f"### {s.name} ({s.family})",
            "",
            f"inputs: {', '.join(_shape(i) for i in s.inputs)} → outputs: {', '.join(_shape(o) for o in s.outputs)}; "
            f"{s.bytes_moved() / 1e6:.3f} MB moved, {s.flops() / 1e6:.3f} MFLOP at the example shapes",
            "",
            f"**selected: {region.selected}** — {region.reason}",
            "",
            "| candidate | family | params | verification | latency |",
            "| --- | --- | --- | --- | --- |",
        ]
        for c in region.candidates:
            lines.append(f"| {c.label} | {c.family} | {_params(c.params)} | {_verdict(c)} | {_latency(c)} |")
        lines.append("")
    lines += ["## End to end", ""]
    e2e = result.e2e
    lines.append(f"- built model vs original on fresh inputs: {'pass' if e2e.get('ok') else 'FAIL'}"
                 f" (max abs err {e2e.get('max_abs_err', float('nan')):.3g})")
    if "speedup" in e2e:
        lines.append(f"- latency: eager {e2e['eager_ms']:.4f} ms, built {e2e['built_ms']:.4f} ms → {e2e['speedup']:.2f}x")
    if result.warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in result.warnings]
    (out / "report.md").write_text("\n".join(lines) + "\n")
