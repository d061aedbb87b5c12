"""Root test configuration.

Without a GPU every generated kernel runs in Triton's interpreter; that must be decided before
anything imports triton.language (its helpers are decorated at import), hence at conftest load.
`@pytest.mark.gpu` tests are skipped when no CUDA device is present.
"""

from __future__ import annotations

import pytest
import torch

from coopt.runtime.kernel_loader import use_interpreter_without_gpu

use_interpreter_without_gpu()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
