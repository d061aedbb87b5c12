"""The examples in the advisor layer's docstrings run."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import coopt.llm_advisor

MODULES = sorted(m.name for m in pkgutil.iter_modules(coopt.llm_advisor.__path__, "coopt.llm_advisor."))


@pytest.mark.parametrize("name", ["coopt.llm_advisor", *MODULES])
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
