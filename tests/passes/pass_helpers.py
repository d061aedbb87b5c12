"""Run a pipeline on a small torch model and look at the result (shared by the pass tests)."""

from __future__ import annotations

from built_calls import beside_eager
from xdsl.context import Context

from coopt.fp8_cache import calibrate_kv_absmax, set_calibration
from coopt.frontend.capture import capture
from coopt.frontend.importer import import_program
from coopt.ir.dialect import KernelOp
from coopt.passes.registry import DEFAULT_PIPELINE, parse_pipeline_text
from coopt.passes.stats import collect_counters

__all__ = ["beside_eager", "kernel_families", "kernels", "run_pipeline"]


def run_pipeline(model, inputs, pipeline: str = DEFAULT_PIPELINE, dynamic_shapes=None, calibrate: bool = False):
    """(module, counters) after `pipeline`; the module is verified after every pass. `calibrate`:
    the KV caches' ranges recorded on `inputs` first, as a build does for fp8-kv-cache's
    calibrated scales."""
    result = import_program(capture(model.eval(), tuple(inputs), dynamic_shapes), tuple(inputs))
    if calibrate:
        set_calibration(result.module, calibrate_kv_absmax(model, [tuple(inputs)]))
    ctx = Context(allow_unregistered=True)
    with collect_counters() as counters:
        for compiler_pass in parse_pipeline_text(pipeline):
            compiler_pass.apply(ctx, result.module)
            result.module.verify()
    return result.module, counters


def kernel_families(module) -> list[str]:
    return [op.family.data for op in module.walk() if isinstance(op, KernelOp)]


def kernels(module) -> list[KernelOp]:
    return [op for op in module.walk() if isinstance(op, KernelOp)]
