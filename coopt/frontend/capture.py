"""Capture with torch.export, then functionalise (in-place buffer writes become outputs)."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

from coopt.errors import CaptureError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _user_frame(exc: BaseException, model_path: Path | None) -> str:
    if model_path is None:
        return ""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == model_path]
    if frames:
        return f" at {model_path.name}:{frames[-1].lineno} ({frames[-1].line})"
    # torch.export errors often carry the user frame only in the message text
    for line in str(exc).splitlines():
        if model_path.name in line:
            return f" at {line.strip()}"
    return ""


def _export(model, example_inputs: tuple, dynamic_shapes, strict: bool):
    with torch.no_grad():
        program = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=strict)
        return program.run_decompositions({})


def capture(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None, model_path: Path | None = None,
            notes: list[str] | None = None):
    """torch.export the model on its example inputs; returns a functional ExportedProgram.

    `run_decompositions({})` functionalises without decomposing: linear, layer_norm, softmax
    and scaled_dot_product_attention stay whole, so raise-patterns sees them as written.

    Non-strict export first (it traces Python as it runs); where that fails, strict export
    (TorchDynamo). Some models need the second: transformers' exportable StaticCache wrapper keeps
    its cache tensors both as buffers and on plain Python objects, which non-strict export lifts
    twice (as a buffer and as a constant of the same storage) and cannot functionalise. Which one
    served is appended to `notes` when it was the second.
    """
    try:
        return _export(model, example_inputs, dynamic_shapes, strict=False)
    except Exception as exc:  # noqa: BLE001 - torch.export raises many types; all mean "could not capture"
        first = exc
    try:
        program = _export(model, example_inputs, dynamic_shapes, strict=True)
    except Exception:  # noqa: BLE001 - the first failure is the one to report: non-strict is the usual form
        exc = first
        hint = "" if dynamic_shapes is not None else "; if an input size varies, define dynamic_shapes() in the model file"
        if any(text in str(exc) for text in ("two different devices", "at least two devices")):
            # a device kept outside the tensors the build moves
            hint = ("; the build moved the model's parameters and buffers to the build device, but the model keeps a "
                    "tensor or a device elsewhere (e.g. transformers' StaticCache): make the model on that device")
        raise CaptureError(
            f"torch.export failed{_user_frame(exc, model_path)}: {type(exc).__name__}: {_first_line(exc)}{hint}"
        ) from exc
    if notes is not None:
        notes.append(f"captured with strict torch.export (non-strict failed: {type(first).__name__}: {_first_line(first)})")
    return program
