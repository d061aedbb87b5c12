"""Per-dtype tolerances and the rule that decides whether one candidate output is correct.

Two references are computed for every example (see check.py):

* ``ref_hi``: the reference module run on the inputs upcast to float64, on the same device as
  the candidate. float64 everywhere, GPU included: H100/H200 run fp64 at half the fp32 rate and
  fuzzing shapes are small, so the cost is negligible, and one rule for both machines keeps CPU
  and GPU verdicts comparable. Only when the reference cannot run in float64 (an op without a
  float64 kernel on that device) is float32 used instead.
* ``ref_native``: the reference module run on the inputs in their own dtypes (what eager PyTorch
  achieves at the model's precision). It may be missing (e.g. eager has no fp8 kernel for an op).

The rule, for one output of expected dtype ``D`` and shape ``s`` (``compare`` implements it).
``D`` is the output's dtype, never the inputs' lowest precision: attention over an fp8 KV cache
(float8_e4m3fn k/v, bf16 q) is judged at bf16, its output's dtype (check.py passes the spec's).

1. The candidate output must be a tensor of dtype ``D`` and shape ``s``: otherwise it fails.
2. Non-finite values: classify each element as finite / NaN / +inf / -inf. Every element of the
   candidate must be in the class of ``ref_hi`` rounded to ``D`` (so a true overflow of ``D``
   is expected to be inf) or in the class of ``ref_native`` at that element (the candidate may
   reproduce what eager does). Any other NaN/inf difference fails, whatever the tolerance.
3. On the elements finite in both the candidate and ``ref_hi``, with ``ref_hi`` clamped to
   ``D``'s finite range (a saturating cast, as torch's to fp8 e4m3fn, is correct),
   ``err = |cand - ref_hi|`` computed in float64 and the output magnitude ``S = max |ref_hi|``
   over those elements:

       floor test:   err <= atol_D * S + rtol_D * |ref_hi| + tiny_D    for every element
       native test:  max(err) <= NATIVE_FACTOR * max |ref_native - ref_hi|

   where ``tiny_D`` is the smallest normal number of ``D`` (flushing subnormals to zero is
   legal). The output passes when the floor test OR the native test passes. ``atol`` is scaled
   by S so that inputs of large magnitude (1e3) or small magnitude (1e-3) are judged relative to
   the size of the result, not in absolute units; ``rtol`` keeps large elements tight.
   NATIVE_FACTOR = 4: a kernel may be up to 4x less accurate than eager at the same precision
   (different accumulation order or a single final rounding vs eager's per-op roundings), so
   bf16 kernels are judged against what eager bf16 itself achieves.
   Where the region has float32 inputs, eager's error is also taken on those inputs moved by
   one float32 ulp each (``ref_near``; the larger of the two errors counts): a computation
   ill-conditioned at the example (attention whose fp32 logits are ~1e3, where one ulp of a
   logit moves a near-tied softmax weight by ~1e-4) can be exact in eager on the drawn inputs by
   luck, and a kernel that rounds once differently is then as right as fp32 allows while far
   over the floor. One ulp of the inputs is what any fp32 computation may already have lost.
   Where the region has bf16 / fp16 inputs, eager also runs on those moved by one ulp of their
   own dtype (``ref_near_low``, two draws), and such a run counts only where it fails the floor
   itself: the example is then ill-conditioned at that precision and the floor no measure of
   it. Session 19: decode attention at magnitude 1000 over 32832 keys, two keys' scores 6e-5
   apart; a kernel rounding the roped query to bf16 once swapped them while eager's own three
   roundings happened not to. Where eager one 16-bit ulp away meets the floor (a
   well-conditioned example) nothing is loosened.
4. Integer and bool outputs must be exactly equal to ``ref_hi`` cast to ``D``.

Reported errors: ``max_abs_err = max(err)`` and ``max_rel_err = max(err) / S``.

Example:

    >>> import torch
    >>> hi = torch.tensor([1000.0, 2.0], dtype=torch.float64)
    >>> compare(torch.tensor([1000.001, 2.0]), hi, None, dtype="float32").ok
    True
    >>> compare(torch.tensor([1000.0, float("nan")]), hi, None, dtype="float32").reason
    'non-finite mismatch at 1 element(s), first at (1,): candidate nan vs reference 2'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A candidate may be this many times less accurate (max error vs ref_hi) than eager at the
# same precision.
NATIVE_FACTOR = 4.0


@dataclass(frozen=True)
class Tolerance:
    """atol is a fraction of S = max|ref_hi| of the output; rtol a fraction of |ref_hi|."""

    atol: float
    rtol: float


# Floors per output dtype. fp32 is far looser than its eps (1.2e-7) because fp32 kernels
# reorder long reductions and Triton's transcendental functions differ from torch's by a few
# ulps; the low-precision floors are about one ulp (atol) and two ulps (rtol) of the dtype.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(atol=1e-10, rtol=1e-10),
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=1e-3, rtol=2e-3),
    "bfloat16": Tolerance(atol=8e-3, rtol=1.6e-2),
    "float8_e4m3fn": Tolerance(atol=6.25e-2, rtol=1.25e-1),
    "float8_e5m2": Tolerance(atol=1.25e-1, rtol=2.5e-1),
}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (names as in TensorSpec.dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Families whose result amplifies rounding of intermediate values: attention's softmax turns an
# error e in a logit of size L into a relative error of about e in the probabilities while e
# itself grows with L, so at the fuzzer's large magnitudes (logits ~1e3) a flash kernel, which
# sums q·k in another order and rescales online, lands a few times over the fp32 floor while
# being as right as eager (measured on the H200: 1.6e-5 of S against the 1e-5 floor).
FAMILY_SLACK = {"attention": 8.0}
# The same for fp32 outputs only: decode attention is that computation split over the keys (flash
# decoding) and merged in a second rescale; a folded cache write's kernel measured 5.2e-5 of S at
# magnitude 30 on the H200 (session 13, rotary tables on the unit circle). Its bf16 outputs keep
# the floor (8x bf16's would pass a 4 % error).
FP32_FAMILY_SLACK = {"decode_attention": 8.0}


def family_slack(family: str, dtype: str) -> float:
    """What multiplies the floor for an output of `dtype` of a region of `family`.

        >>> family_slack("decode_attention", "float32"), family_slack("decode_attention", "bfloat16")
        (8.0, 1.0)
    """
    if dtype == "float32" and family in FP32_FAMILY_SLACK:
        return FP32_FAMILY_SLACK[family]
    return FAMILY_SLACK.get(family, 1.0)


def tolerance_for(dtype: str | torch.dtype) -> Tolerance:
    """The floor for a floating dtype; unknown floating dtypes get one ulp / two ulps of eps."""
    dtype = torch_dtype(dtype)
    known = TOLERANCES.get(dtype_name(dtype))
    if known is not None:
        return known
    eps = torch.finfo(dtype).eps
    return Tolerance(atol=eps, rtol=2 * eps)


@dataclass(frozen=True)
class Comparison:
    """Verdict on one output. max_rel_err is max_abs_err / S (see the module docstring)."""

    ok: bool
    max_abs_err: float
    max_rel_err: float
    reason: str | None = None


def compare(
    candidate,
    ref_hi: torch.Tensor,
    ref_native: torch.Tensor | None,
    *,
    dtype: str | torch.dtype,
    shape: tuple[int, ...] | None = None,
    slack: float = 1.0,
    ref_near: torch.Tensor | None = None,
    ref_near_low: tuple[torch.Tensor, ...] = (),
) -> Comparison:
    """Apply the module docstring's rule to one output; `reason` is one line when not ok.
    `slack` multiplies the floor (FAMILY_SLACK of the region's family); `ref_near` is eager on
    the inputs moved by one float32 ulp (the native test takes the larger of its error and
    ref_native's); `ref_near_low` eager on the 16-bit inputs moved by one ulp of their dtype,
    each counted only where it fails the floor."""
    expected_dtype = torch_dtype(dtype)
    shape = tuple(ref_hi.shape) if shape is None else tuple(shape)
    if not isinstance(candidate, torch.Tensor):
        return _fail(f"expected a tensor, got {type(candidate).__name__}")
    if candidate.dtype != expected_dtype:
        return _fail(f"dtype {dtype_name(candidate.dtype)}, expected {dtype_name(expected_dtype)}")
    if tuple(candidate.shape) != shape:
        return _fail(f"shape {tuple(candidate.shape)}, expected {shape}")
    if tuple(ref_hi.shape) != shape:
        return _fail(f"reference has shape {tuple(ref_hi.shape)}, expected {shape}")
    candidate = candidate.detach()
    ref_hi = ref_hi.detach().to(candidate.device)
    ref_native, ref_near = (_as_spec(r, candidate.device, shape) for r in (ref_native, ref_near))
    ref_near_low = tuple(r for r in (_as_spec(r, candidate.device, shape) for r in ref_near_low) if r is not None)
    if candidate.numel() == 0:
        return Comparison(True, 0.0, 0.0)
    if not expected_dtype.is_floating_point:
        return _compare_exact(candidate, ref_hi, expected_dtype)
    return _compare_floating(candidate, ref_hi, ref_native, expected_dtype, slack, ref_near, ref_near_low)


def _as_spec(eager: torch.Tensor | None, device, shape) -> torch.Tensor | None:
    """An eager result on the candidate's device; None where there is none or it disagrees with
    the spec's shape (then the floor alone judges)."""
    if eager is None:
        return None
    eager = eager.detach().to(device)
    return eager if tuple(eager.shape) == shape else None


def _compare_exact(candidate: torch.Tensor, ref_hi: torch.Tensor, dtype: torch.dtype) -> Comparison:
    expected = ref_hi.to(dtype)
    if torch.equal(candidate, expected):
        return Comparison(True, 0.0, 0.0)
    err = (candidate.double() - expected.double()).abs()
    index = _unravel(int(err.argmax()), candidate.shape)
    return Comparison(
        False, float(err.max()), float("inf"),
        f"{dtype_name(dtype)} output differs at {int((err > 0).sum())} element(s), first at "
        f"{index}: candidate {_fmt(candidate[index])} vs reference {_fmt(expected[index])}",
    )


def _compare_floating(candidate, ref_hi, ref_native, dtype: torch.dtype, slack: float = 1.0,
                      ref_near=None, ref_near_low=()) -> Comparison:
    cand = candidate.double()
    hi = ref_hi.double()
    native = None if ref_native is None else ref_native.double()
    near = None if ref_near is None else ref_near.double()

    # Rule 2: NaN/inf classes must match rounded ref_hi or eager, element by element.
    cand_class = _value_class(cand)
    bad = cand_class != _value_class(hi.to(dtype).double())
    if native is not None:
        bad &= cand_class != _value_class(native)
    if bool(bad.any()):
        index = _unravel(int(bad.flatten().nonzero()[0]), cand.shape)
        return _fail(
            f"non-finite mismatch at {int(bad.sum())} element(s), first at {index}: "
            f"candidate {_fmt(cand[index])} vs reference {_fmt(hi[index])}"
        )

    # Rule 3 on the elements finite in both.
    both_finite = torch.isfinite(cand) & torch.isfinite(hi)
    largest = torch.finfo(dtype).max
    hi = hi.clamp(-largest, largest)
    if not bool(both_finite.any()):
        return Comparison(True, 0.0, 0.0)
    zero = torch.zeros((), dtype=torch.float64, device=cand.device)
    err = torch.where(both_finite, (cand - hi).abs(), zero)
    magnitude = torch.where(both_finite, hi.abs(), zero)
    scale = float(magnitude.max())
    tiny = torch.finfo(dtype).tiny
    max_abs = float(err.max())
    max_rel = max_abs / max(scale, tiny)

    tol = tolerance_for(dtype)
    bound = slack * (tol.atol * scale + tol.rtol * magnitude) + tiny
    if bool((err <= bound).all()):
        return Comparison(True, max_abs, max_rel)
    native_err = _native_error(native, hi, both_finite)
    near_err = _native_error(near, hi, both_finite)
    if near_err is not None:  # eager one input ulp away: what fp32 cannot tell apart here
        native_err = near_err if native_err is None else max(native_err, near_err)
    for low in ref_near_low:  # eager one 16-bit ulp away, where it fails the floor itself
        low_err = _error_over_floor(low.double(), hi, both_finite, bound)
        if low_err is not None:
            native_err = low_err if native_err is None else max(native_err, low_err)
    if native_err is not None and max_abs <= NATIVE_FACTOR * native_err:
        return Comparison(True, max_abs, max_rel)

    index = _unravel(int((err - bound).argmax()), cand.shape)
    eager = "no eager result" if native_err is None else (
        f"{NATIVE_FACTOR:g}x eager {dtype_name(dtype)} error {native_err:.3g}")
    return Comparison(
        False, max_abs, max_rel,
        f"max abs err {max_abs:.3g} ({max_rel:.3g} of S=max|ref|={scale:.3g}); worst at {index}: "
        f"candidate {_fmt(cand[index])} vs reference {_fmt(hi[index])}; exceeds the "
        f"{dtype_name(dtype)} floor (atol {tol.atol:g}*S + rtol {tol.rtol:g}*|ref|) and {eager}",
    )


def _eager_errors(eager, hi, both_finite) -> torch.Tensor | None:
    """|eager - ref_hi| where all three are finite (0 elsewhere); None where none is."""
    mask = both_finite & torch.isfinite(eager)
    if not bool(mask.any()):
        return None
    zero = torch.zeros((), dtype=torch.float64, device=hi.device)
    return torch.where(mask, (eager - hi).abs(), zero)


def _native_error(native, hi, both_finite) -> float | None:
    """max |ref_native - ref_hi| where all three are finite; None without an eager result."""
    err = None if native is None else _eager_errors(native, hi, both_finite)
    return None if err is None else float(err.max())


def _error_over_floor(eager, hi, both_finite, bound) -> float | None:
    """max |eager - ref_hi| where `eager` exceeds the floor `bound` somewhere (all three
    finite), else None: an eager run that meets the floor says nothing of the example's
    conditioning."""
    err = _eager_errors(eager, hi, both_finite)
    return float(err.max()) if err is not None and bool((err > bound).any()) else None


def _value_class(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    cls = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    cls[torch.isnan(t)] = 1
    cls[t == float("inf")] = 2
    cls[t == float("-inf")] = 3
    return cls


def _unravel(flat: int, shape) -> tuple[int, ...]:
    index = []
    for size in reversed(tuple(shape)):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def _fmt(value: torch.Tensor) -> str:
    return f"{float(value):.6g}"


def _fail(reason: str) -> Comparison:
    nan = float("nan")
    return Comparison(False, nan, nan, reason)
