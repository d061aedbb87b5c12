"""Plugins: examples/plugin is installed (into a private directory) and used from the CLI;
two packages offering the same pass name is an error naming both."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pip_install(source: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )


def coopt(args, site: Path, cwd: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "coopt.cli.main", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    pip_install(ROOT / "examples" / "plugin", site)
    return site


def test_installed_plugin_pass_is_listed_and_runs_in_a_build(plugin_site, tmp_path):
    listed = coopt(["passes"], plugin_site, tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "tag-fallbacks: example plugin pass" in listed.stdout
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, x):
                return torch.cumprod(x, -1).relu()
        def get_inputs():
            return [torch.randn(4, 8)]
    """))
    out = tmp_path / "out"
    built = coopt(["build", model, "-o", out, "-q", "--top-k", "1", "-p", "raise-patterns,tag-fallbacks{start=7},fuse-elementwise"], plugin_site, tmp_path)
    assert built.returncode == 0, built.stderr
    assert "plugin.ordinal = 7" in (out / "ir" / "02-tag-fallbacks.mlir").read_text()
    assert '"tag-fallbacks": "coopt-example-plugin"' in (out / "manifest.json").read_text()


def test_two_packages_offering_one_pass_name_clash(plugin_site, tmp_path):
    clone = tmp_path / "clone"
    (clone / "coopt_clone_plugin").mkdir(parents=True)
    (clone / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "coopt-clone-plugin"
        version = "0.1.0"
        [project.entry-points."coopt.plugins"]
        clone = "coopt_clone_plugin:plugin"
        [tool.setuptools]
        packages = ["coopt_clone_plugin"]
    """))
    (clone / "coopt_clone_plugin" / "__init__.py").write_text(
        "from types import SimpleNamespace\nfrom coopt_example_plugin import TagFallbacks\nplugin = SimpleNamespace(passes={'tag-fallbacks': TagFallbacks})\n"
    )
    site2 = tmp_path / "site2"
    pip_install(clone, site2)
    env_site = Path(f"{plugin_site}{os.pathsep}{site2}")
    result = coopt(["passes"], env_site, tmp_path)
    assert result.returncode == 10
    assert "plugin clash: pass 'tag-fallbacks' is provided by both" in result.stderr
    assert "coopt-example-plugin" in result.stderr and "coopt-clone-plugin" in result.stderr
