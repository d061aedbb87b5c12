"""Fixtures of the Llama model tests: the model file imported once, a clean environment."""

from __future__ import annotations

import os

import pytest

from coopt.frontend.model_file import import_model_file
from llama_helpers import MODEL_PATH


@pytest.fixture(scope="session")
def llama():
    """examples/llama/model.py as a module."""
    return import_model_file(MODEL_PATH)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No COOPT_LLAMA_* / COOPT_EXAMPLE_DTYPE from the caller's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith("COOPT_LLAMA_") or name == "COOPT_EXAMPLE_DTYPE":
            monkeypatch.delenv(name)
