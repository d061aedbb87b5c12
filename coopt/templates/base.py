"""What every template family declares, and how a candidate's source is rendered.

A family turns a `RegionSummary` plus one choice of parameters into the source of a plain Python
module (torch + triton only) that defines

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]

taking the region's inputs in `RegionSummary.inputs` order and returning its outputs in
`RegionSummary.outputs` order. The module is written to `out/kernels/` and imported by the
emitted program, so it must not import coopt's compiler (xdsl, jinja2, hypothesis).

Legality lives here, not in the advisor: `param_space` is bounded and every point of it that
`check` accepts must be correct. The advisor only ranks points.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jinja2

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import Target

TEMPLATE_DIR = Path(__file__).parent

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


def render_template(relative_path: str, **context) -> str:
    """Render `templates/<relative_path>` with StrictUndefined (a missing variable is an error)."""
    return _ENV.get_template(relative_path).render(**context)


def render_string(source: str, **context) -> str:
    """Render a template held in a string (bench/'s probes) like a template file: it may include
    `templates/*` files (the CUDA helpers in templates/cuda/)."""
    return _ENV.from_string(source).render(**context)


# -- shape facts the families' legality checks share ----------------------------------------


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dim_range(region: RegionSummary, dims) -> tuple[int, int | None]:
    """(min, max) of the product of `dims`; max is None when a symbolic dim has no known bound.

    A dim is an int, a symbol with a range in `region.dims`, or an expression of symbols
    ("4*s0"), bounded by evaluating it at the symbols' minima and maxima (monotone without "-").
    """
    lows = {name: r[0] for name, r in region.dims.items()}
    highs = {name: r[1] for name, r in region.dims.items()}
    lo, hi = 1, 1
    for d in dims:
        try:
            if isinstance(d, str) and "-" in d:
                raise ValueError(d)
            d_lo = TensorSpec((d,), "float32").concrete(lows)[0]
            d_hi = TensorSpec((d,), "float32").concrete(highs)[0]
        except Exception:  # unknown symbol or expression: unbounded
            d_lo, d_hi = 1, None
        lo = lo * d_lo
        hi = None if hi is None or d_hi is None else hi * d_hi
    return lo, hi


def lane_fill_problem(what: str, elements: int, num_warps: int, most_per_thread: int) -> str | None:
    """Why a program of `elements` pointwise elements suits `num_warps` badly, or None: fewer
    elements than threads leave lanes idle; more than `most_per_thread` each spill registers."""
    threads = 32 * num_warps
    if elements < threads:
        return f"{what} leaves threads idle with num_warps={num_warps} (needs >= {threads} elements)"
    if elements // threads > most_per_thread:
        return f"{what} is over {most_per_thread} elements per thread with num_warps={num_warps}"
    return None


def max_extent(dim, region: RegionSummary) -> int | None:
    """Largest value one dim takes; None when a symbol in it has no known range."""
    return dim_range(region, [dim])[1]


@dataclass(frozen=True)
class Candidate:
    """One instantiation of a family for one region: what verify/tune/emit handle."""

    region: str
    family: str
    params: dict
    source: str  # Python module source defining run(*inputs)

    @property
    def label(self) -> str:
        return f"{self.family}[" + ",".join(f"{k}={v}" for k, v in sorted(self.params.items())) + "]"


def cuda_runs_here() -> bool:
    """Whether this process can compile and run CUDA C++ candidates (and so verify them): the
    CUDA families offer no point without it (tests patch it here)."""
    import torch

    return torch.cuda.is_available()


def cuda_point_problem(shared: int, target: Target) -> str | None:
    """The last checks of a CUDA C++ family's point: its block's shared memory fits the target,
    and this process can verify it (an unverified candidate never reaches out/)."""
    if shared > target.smem_per_block_bytes:
        return f"{shared} B of shared memory > {target.smem_per_block_bytes} B"
    if not cuda_runs_here():
        return "CUDA C++ candidates are verified on an NVIDIA GPU, and this machine has none"
    return None


class TemplateFamily:
    """Base class: subclasses set `name` and implement the four methods."""

    name: ClassVar[str]

    def matches(self, region: RegionSummary) -> bool:
        """Whether this family can implement the region at all (family name and attrs)."""
        return region.family == self.name

    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        """Bounded space: knob -> allowed values. Every knob's list is short and explicit."""
        raise NotImplementedError

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        """None when `params` is legal for `region` on `target`, else a one-line reason."""
        return None

    def render(self, region: RegionSummary, params: dict) -> str:
        raise NotImplementedError

    def pdl_ready(self, region: RegionSummary, params: dict) -> bool:
        """Whether this point's kernel is one a step launched with PDL gains from (families built
        for PDL say which of their points are: tune/pdl_ready.py may re-select them for a PDL
        option, candidates.make_candidates measures one); most families have none."""
        return False

    # -- shared helpers --------------------------------------------------------------
    def outside_space(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        """The first knob of `params` whose value the space does not list, as a one-line reason
        (for `check` of families whose points may come from elsewhere: an LLM advisor, a cache)."""
        for knob, values in self.param_space(region, target).items():
            if params.get(knob) not in values:
                return f"{knob}={params.get(knob)} is not in the space"
        return None

    def legal_points(self, region: RegionSummary, target: Target, space: dict[str, list] | None = None) -> list[dict]:
        """Every legal point of the space (`space`: a family's own reduction of it), in a deterministic order."""
        space = self.param_space(region, target) if space is None else space
        keys = sorted(space)
        points = []
        for values in itertools.product(*(space[k] for k in keys)):
            params = dict(zip(keys, values))
            if self.check(region, params, target) is None:
                points.append(params)
        return points

    def instantiate(self, region: RegionSummary, params: dict) -> Candidate:
        return Candidate(region.name, self.name, dict(params), self.render(region, params))
