"""out/weights.pt and out/zeros.json: the tensors a built program starts from.

A KV cache that starts empty is all zeros: a paged build's page pool is the whole KV budget
(4 GiB in bench/capacity.py), a prompt build's cache holds its longest prompt. Written into
weights.pt such tensors cost the disk, the emit and every load, of which a build's end-to-end
check makes several. So an all-zero tensor is stored as its shape and dtype in zeros.json, and
the program's loader (templates/program.py.j2, `_load_state`) makes it with torch.zeros on the device: the same
tensor, none of its bytes on disk. A zero tensor that shares storage with another stored one
stays in weights.pt (torch.save keeps the sharing; zeros.json could not).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from coopt.emit.outdir import ensure_free_space
from coopt.errors import OutputDirError

WEIGHTS_FILE = "weights.pt"
ZEROS_FILE = "zeros.json"  # {name: {"shape": [...], "dtype": "bfloat16"}}, beside weights.pt


def save_state(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """weights.pt with every tensor but the unshared all-zero ones, which go to zeros.json."""
    storages = Counter(t.untyped_storage().data_ptr() for t in tensors.values())
    zeros = {name: t for name, t in tensors.items()
             if t.numel() and storages[t.untyped_storage().data_ptr()] == 1 and _zero_bits(t)}
    stored = {name: t for name, t in tensors.items() if name not in zeros}
    ensure_free_space(Path(out), stored_bytes(stored.values()), "the build's weights")
    try:
        torch.save(stored, Path(out) / WEIGHTS_FILE)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        raise OutputDirError(f"cannot write '{Path(out) / WEIGHTS_FILE}': {str(exc).splitlines()[0]}") from exc
    specs = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for name, t in zeros.items()}
    (Path(out) / ZEROS_FILE).write_text(json.dumps(specs, indent=1, sort_keys=True))


def stored_bytes(tensors) -> int:
    """Bytes torch.save writes for these tensors' data: each storage once, however many share it."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _zero_bits(tensor: torch.Tensor) -> bool:
    """Whether every bit of `tensor` is zero, so torch.zeros remakes it exactly (a -0.0 is not).
    Read as bytes: CUDA has no any() for float8 (session 10: every fp8 build failed to save)."""
    return not tensor.detach().contiguous().view(-1).view(torch.uint8).any()


def stored_state(weights_file: Path, device="meta") -> dict[str, torch.Tensor]:
    """Every tensor a weights.pt and the zeros.json beside it hold, on `device` (the default meta
    device reads names, shapes and dtypes, no data). The built program's own loader does the same
    without importing coopt (templates/program.py.j2 `_load_state`)."""
    weights_file = Path(weights_file)
    tensors = torch.load(weights_file, map_location=device, weights_only=True)
    zeros_file = weights_file.parent / ZEROS_FILE
    if zeros_file.is_file():
        for name, spec in json.loads(zeros_file.read_text()).items():
            tensors[name] = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
    return tensors
