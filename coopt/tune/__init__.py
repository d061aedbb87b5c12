"""Latency measurement, tuning cache and selection of verified candidates.

Legality is decided elsewhere (templates check, verify proves); this package only times what
was verified and picks the fastest, keeping the reference when nothing beats it.

    measure_candidates(region, {label: path})  -> {label: Measurement}   (measure.py)
    select_candidate(candidates, measurements) -> (label, reason)        (select.py)
    tune_build_dir(out_dir)                    -> `coopt tune out/`      (retune.py)
    TuningDB(path)                             -> sqlite cache of measurements (db.py)

A region's candidates are timed one after another in a `python -m coopt.tune.worker`
subprocess (worker.py); a crashing, hanging or failing kernel costs one error entry and a fresh
worker for the candidates after it, never the build.
"""

from coopt.tune.measurement import Measurement

__all__ = ["Measurement"]
