"""Plugins: passes, templates, advisors and targets from installed packages.

One entry-point group, `coopt.plugins`. Each entry point names an object with any of the
attributes `passes`, `templates`, `advisors`, `targets`: dicts from name to a class (or, for
targets, a `Target`). A name offered by two packages, or by a package and coopt itself, is an
error naming both.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points

from coopt.errors import PluginError

GROUP = "coopt.plugins"
KINDS = ("passes", "templates", "advisors", "targets")
_SINGULAR = {"passes": "pass", "templates": "template", "advisors": "advisor", "targets": "target"}


@functools.cache
def _collect() -> dict[str, dict[str, tuple[str, object]]]:
    """kind -> name -> (package, object). Cached: entry points do not change within a process."""
    found: dict[str, dict[str, tuple[str, object]]] = {k: {} for k in KINDS}
    for ep in entry_points(group=GROUP):
        package = ep.dist.name if ep.dist is not None else ep.value
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not crash the build with a traceback
            raise PluginError(f"plugin '{ep.name}' from package '{package}' failed to load: {exc}") from exc
        for kind in KINDS:
            for name, obj in (getattr(plugin, kind, None) or {}).items():
                if name in found[kind]:
                    other = found[kind][name][0]
                    raise PluginError(
                        f"plugin clash: {_SINGULAR[kind]} '{name}' is provided by both '{other}' and '{package}'"
                    )
                found[kind][name] = (package, obj)
    return found


def _objects(kind: str) -> dict[str, object]:
    return {name: obj for name, (_, obj) in _collect()[kind].items()}


def plugin_packages(kind: str) -> dict[str, str]:
    """name -> providing package, for the manifest and clash messages."""
    return {name: pkg for name, (pkg, _) in _collect()[kind].items()}


def plugin_passes() -> dict:
    return _objects("passes")


def plugin_templates() -> dict:
    return _objects("templates")


def plugin_advisors() -> dict:
    return _objects("advisors")


def plugin_targets() -> dict:
    return _objects("targets")


def check_builtin_clash(kind: str, builtin_names) -> None:
    """A plugin may not reuse a built-in name."""
    for name, (pkg, _) in _collect()[kind].items():
        if name in builtin_names:
            raise PluginError(f"plugin clash: {_SINGULAR[kind]} '{name}' is provided by both 'coopt' and '{pkg}'")
