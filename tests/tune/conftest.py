"""Fixtures for tests/tune (helpers live in tune_helpers.py)."""

from __future__ import annotations

import pytest
from tune_helpers import add_region

from coopt.ir.region import RegionSummary


@pytest.fixture
def region() -> RegionSummary:
    return add_region()
