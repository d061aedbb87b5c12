"""Targets: the hardware facts passes, templates and the advisor may use.

Figures are the ones measured on the lent H200 (copy bandwidth, bf16 matmul rate) or datasheet
leads where nothing was measured; they guide choices, they are never reported as results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from coopt.errors import ConfigError


@dataclass(frozen=True)
class Target:
    name: str
    arch: str  # "sm_90" for Hopper
    num_sms: int
    l2_bytes: int
    smem_per_block_bytes: int
    hbm_bytes_per_s: float
    bf16_flop_per_s: float
    fp32_flop_per_s: float
    supports_fp8: bool

    def facts(self) -> dict:
        """JSON-ready facts for region summaries and advisor prompts."""
        return asdict(self)


H100 = Target("h100", "sm_90", 132, 50 * 2**20, 227 * 1024, 3.35e12, 790e12, 67e12, True)
H200 = Target("h200", "sm_90", 132, 60 * 2**20, 227 * 1024, 4.2e12, 790e12, 67e12, True)

_BUILTIN = {t.name: t for t in (H100, H200)}


def known_targets() -> dict[str, Target]:
    """Built-in targets plus those registered by plugins."""
    from coopt.plugins import plugin_targets

    return {**_BUILTIN, **plugin_targets()}


def get_target(name: str) -> Target:
    targets = known_targets()
    if name not in targets:
        raise ConfigError(f"unknown target '{name}'; known targets: {', '.join(sorted(targets))}")
    return targets[name]
