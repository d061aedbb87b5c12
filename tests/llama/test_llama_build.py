"""`coopt build examples/llama/model.py` on the tiny preset (2 layers): the build succeeds through
the CLI, and the loaded build reproduces eager decode steps, cache writes included.

Without a GPU the kernels run in Triton's interpreter; this build takes about 30 s here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import coopt
from coopt.frontend.model_file import load_model_file
from llama_helpers import MODEL_PATH


def test_cli_build_of_the_tiny_decode_step_matches_eager(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COOPT_LLAMA_") and k != "COOPT_EXAMPLE_DTYPE"}
    command = [sys.executable, "-m", "coopt.cli.main", "build", str(MODEL_PATH), "-o", str(out), "--top-k", "1", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    build = json.loads(result.stdout[result.stdout.index("{"):])
    assert build["end_to_end"]["ok"]

    eager = load_model_file(MODEL_PATH)  # same seeds: the weights and cache history of the build
    built = coopt.load(out)
    tokens, input_pos = eager.example_inputs
    with torch.no_grad():  # two steps: the second attends to the keys the first one wrote
        for step in range(2):
            position = input_pos + step
            torch.testing.assert_close(built(tokens, position), eager.model(tokens, position), rtol=1e-4, atol=1e-4)
            tokens = (tokens * 7 + 3) % eager.model.args.vocab_size
