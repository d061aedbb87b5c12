"""`VerifyResult`: what verification says about one candidate (plain data, JSON-ready)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one candidate (or a whole built model).

    ok            every example passed
    examples      how many examples (input sets) were actually run
    max_abs_err   largest |candidate - reference| seen over all examples and outputs
    max_rel_err   that error relative to the output's magnitude S = max|reference| (see
                  tolerances.py), the largest over all examples and outputs
    failure       one line saying what failed and on which example, or None
    repro         path of the repro script written for the failure, or None
    falsifying_example  the (shrunk) failing example as {"dims", "seed", "magnitude"}, or None

    >>> VerifyResult.failed("crashed: worker died with SIGSEGV").ok
    False
    """

    ok: bool
    examples: int
    max_abs_err: float
    max_rel_err: float
    failure: str | None = None
    repro: str | None = None
    falsifying_example: dict | None = None

    @staticmethod
    def failed(failure: str, examples: int = 0) -> "VerifyResult":
        """A failure with no error measurement (import error, crash, timeout)."""
        nan = float("nan")
        return VerifyResult(False, examples, nan, nan, failure)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> "VerifyResult":
        return VerifyResult(**data)
