"""The training text every machine has: the Python standard library's own `*.py` sources, as
bytes (vocabulary 256), split into train and held-out by file.

    data = load_corpus()               # ~12 MB on CPython 3.11
    data.train, data.heldout           # uint8 tensors [N]
    data.describe()                    # Python version, file and byte counts, a digest

Deterministic for a given Python version: files sorted by their path relative to the stdlib
root, every 10th file (by that order) held out, each file followed by a NUL byte (a document
boundary: NUL does not occur in source text). Left out, because distributions differ in whether
they ship them: site-packages and the test suites (`test/`, `*/tests/`, `idlelib/idle_test/`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

HELDOUT_EVERY = 10  # file i (sorted order) is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1
DOCUMENT_END = b"\x00"
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "tests", "idle_test"}
_SKIPPED_TOP = {"test"}  # the CPython regression suite, absent from some distributions' python3


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [N_train]
    heldout: torch.Tensor  # uint8 [N_heldout]
    train_files: list[str] = field(repr=False)
    heldout_files: list[str] = field(repr=False)
    root: str = ""

    def describe(self) -> dict:
        """What the corpus is, for reports: enough to tell whether two runs saw the same text."""
        digest = hashlib.sha256(self.train.numpy().tobytes() + self.heldout.numpy().tobytes()).hexdigest()
        return {
            "source": "python stdlib *.py (no site-packages, no test suites)",
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "root": self.root,
            "train_files": len(self.train_files),
            "heldout_files": len(self.heldout_files),
            "train_bytes": int(self.train.numel()),
            "heldout_bytes": int(self.heldout.numel()),
            "heldout_rule": f"every {HELDOUT_EVERY}th file in sorted relative-path order",
            "sha256": digest[:16],
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """Relative paths (POSIX) of the stdlib's *.py files, sorted, skipped directories pruned."""
    found = []
    for directory, subdirs, files in os.walk(root):
        relative = Path(directory).relative_to(root)
        # pruned in place so os.walk never descends into site-packages (large, machine-specific)
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS and not (relative == Path(".") and d in _SKIPPED_TOP)]
        found.extend((relative / name).as_posix() for name in files if name.endswith(".py"))
    return sorted(found)


def load_corpus(max_bytes: int | None = None, root: str | Path | None = None) -> Corpus:
    """The stdlib corpus; `max_bytes` keeps only the first files (sorted order) up to about that
    many bytes in all (both splits), for fast tests. Example: `load_corpus(max_bytes=1 << 20)`."""
    root = Path(root) if root is not None else stdlib_root()
    splits: dict[str, list[bytes]] = {"train": [], "heldout": []}
    names: dict[str, list[str]] = {"train": [], "heldout": []}
    total = 0
    for index, name in enumerate(source_files(root)):
        if max_bytes is not None and total >= max_bytes:
            break
        text = (root / name).read_bytes() + DOCUMENT_END
        split = "heldout" if index % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"
        splits[split].append(text)
        names[split].append(name)
        total += len(text)
    if not names["train"] or not names["heldout"]:
        raise ValueError(f"too little text under {root} for both splits (max_bytes={max_bytes})")

    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)

    return Corpus(as_tensor(splits["train"]), as_tensor(splits["heldout"]), names["train"], names["heldout"], str(root))
