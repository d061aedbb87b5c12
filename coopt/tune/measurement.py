"""The result of timing one candidate: plain data shared by measure, db, select and retune."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Measurement:
    """Latency quantiles of one candidate at one set of dims, or why it could not be timed.

    `bytes_moved` and `flops` are the region's floors at the measured dims (see
    `RegionSummary.bytes_moved` / `.flops`), kept so achieved rates can be derived.

    >>> m = Measurement(median_ms=0.5, p20_ms=0.49, p80_ms=0.52, bytes_moved=10**9, flops=0)
    >>> round(m.achieved_gbps)
    2000
    """

    median_ms: float | None
    p20_ms: float | None
    p80_ms: float | None
    error: str | None = None
    device: str = ""  # GPU name the worker ran on, or "cpu" for the test-only CPU path
    bytes_moved: int = 0
    flops: int = 0
    method: str = ""  # "events" (launch included), "cuda-graph" (GPU time only), "cpu-wall"

    @staticmethod
    def failed(error: str, **extra) -> "Measurement":
        """A measurement that did not happen (crash, timeout, exception) with a one-line reason."""
        return Measurement(median_ms=None, p20_ms=None, p80_ms=None, error=error, **extra)

    @property
    def ok(self) -> bool:
        return self.error is None and self.median_ms is not None

    @property
    def achieved_gbps(self) -> float | None:
        """Minimum bytes over median time, in GB/s (1e9 bytes per second)."""
        if not self.ok or self.median_ms <= 0:
            return None
        return self.bytes_moved / (self.median_ms * 1e-3) / 1e9

    @property
    def achieved_tflops(self) -> float | None:
        """Region flops over median time, in TFLOP/s."""
        if not self.ok or self.median_ms <= 0:
            return None
        return self.flops / (self.median_ms * 1e-3) / 1e12

    def to_json(self) -> dict:
        """Fields plus the derived rates (for selection.json and reports)."""
        data = asdict(self)
        data["achieved_gbps"] = self.achieved_gbps
        data["achieved_tflops"] = self.achieved_tflops
        return data

    @staticmethod
    def from_json(data: dict) -> "Measurement":
        return Measurement(
            median_ms=data.get("median_ms"),
            p20_ms=data.get("p20_ms"),
            p80_ms=data.get("p80_ms"),
            error=data.get("error"),
            device=data.get("device", ""),
            bytes_moved=int(data.get("bytes_moved", 0)),
            flops=int(data.get("flops", 0)),
            method=data.get("method", ""),
        )
