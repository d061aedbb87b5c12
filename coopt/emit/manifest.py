"""out/manifest.json: what produced this build (versions, target, pipeline, advisor, seeds)."""

from __future__ import annotations

import datetime
import json
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("coopt", "torch", "triton", "xdsl", "jinja2", "hypothesis"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def write_manifest(out: Path, config, model_path, result) -> None:
    from coopt.plugins import plugin_packages

    manifest = {
        "coopt_manifest_version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_file": str(model_path) if model_path else None,
        "target": config.target.facts(),
        "gpu": gpu_name(),
        "pipeline": config.pipeline_text,
        "lossy_passes": [p.name for p in config.passes if getattr(p, "lossy", False)],
        "precision": "as the model (fp32 stays IEEE fp32; bf16/fp16 accumulate in fp32)",
        "advisor": config.advisor_name,
        "top_k": config.top_k,
        "verify_profile": config.verify_profile,
        "seed": config.seed,
        "measured": result.measured,
        "versions": package_versions(),
        "plugins": {kind: plugin_packages(kind) for kind in ("passes", "templates", "advisors", "targets")},
        "build_seconds": round(result.seconds, 2),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
