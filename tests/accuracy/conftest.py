"""Fixtures of the accuracy harness tests: a small slice of the stdlib corpus and the tiny model
trained on it for a few dozen steps, once for every test file here (training is the slow part)."""

from __future__ import annotations

import pytest

from coopt.accuracy import train
from coopt.accuracy.corpus import load_corpus

SEQ_LEN = 64


@pytest.fixture(scope="session")
def corpus():
    return load_corpus(max_bytes=400_000)


@pytest.fixture(scope="session")
def trained(corpus):
    """The tiny config after a few dozen steps, with its history."""
    return train.train("tiny", steps=40, batch=16, seq_len=SEQ_LEN, seed=0, log_every=10, corpus=corpus,
                       heldout_windows_count=8, log=lambda line: None)
