"""Fixtures for tests/verify (helpers live in verify_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from verify_helpers import MUL_ADD_REFERENCE, write_module


@pytest.fixture
def mul_add_reference(tmp_path) -> Path:
    return write_module(tmp_path / "kernels", "ew0__reference", MUL_ADD_REFERENCE)
