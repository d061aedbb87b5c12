"""The worker side of isolated verification: `python -m coopt.verify.worker`.

Protocol, one JSON object per line:

    worker -> parent  {"ready": true, "pid": N}    once torch/triton/hypothesis are imported
    parent -> worker  {"label", "region", "reference", "candidate",
                       "profile", "seed", "device", "repro_dir"}
    worker -> parent  {"label", "result": VerifyResult.to_json(), "poisoned": bool}
    parent -> worker  {"exit": true}  (or closes stdin)

The protocol runs over private duplicates of fds 0 and 1; fd 1 is pointed at stderr and fd 0 at
/dev/null, so prints from candidates, Triton or C libraries cannot corrupt it. After a CUDA
fault the context is unusable, so the worker reports "poisoned" and exits; the parent starts a
fresh one for the next candidate. Crashes and hangs are the parent's to detect (isolated.py).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys


def _private_protocol_streams():
    protocol_in = os.fdopen(os.dup(0), "r")
    protocol_out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol_in, protocol_out


def _send(stream, message: dict) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def _device_poisoned() -> bool:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001 - any CUDA error here means the context is gone
        return True


def _verify(request: dict) -> dict:
    from coopt.ir.region import RegionSummary
    from coopt.verify.check import one_line
    from coopt.verify.result import VerifyResult
    from coopt.verify.runner import verify_candidate

    try:
        result = verify_candidate(
            RegionSummary.from_json(request["region"]),
            request["reference"],
            request["candidate"],
            profile=request.get("profile"),
            seed=int(request.get("seed", 0)),
            device=request.get("device"),
            repro_dir=request.get("repro_dir"),
            label=request["label"],
        )
    except BaseException as error:  # noqa: BLE001 - a verifier bug must not kill the batch
        result = VerifyResult.failed(f"verifier error: {one_line(error)}")
    return result.to_json()


def main() -> None:
    protocol_in, protocol_out = _private_protocol_streams()
    faulthandler.enable()  # a segfault leaves a Python traceback on stderr for the parent
    # Import everything heavy now, so a candidate's timeout is not spent importing.
    from coopt.runtime.kernel_loader import use_interpreter_without_gpu

    use_interpreter_without_gpu()
    import triton  # noqa: F401

    import coopt.verify.runner  # noqa: F401

    _send(protocol_out, {"ready": True, "pid": os.getpid()})
    for line in protocol_in:
        request = json.loads(line)
        if request.get("exit"):
            break
        result = _verify(request)
        poisoned = _device_poisoned()
        _send(protocol_out, {"label": request["label"], "result": result, "poisoned": poisoned})
        if poisoned:
            break


if __name__ == "__main__":
    main()
