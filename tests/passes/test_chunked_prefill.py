"""chunked-prefill (docs/kv-cache.md "Chunked prefill"): on a decoder step with a dynamic prompt
length the pass narrows that dim's range to the chunk and records `coopt.prefill_chunk`; a module
without a dynamic prompt length, or a chunk that is not a power of two >= 16, is a pipeline
error (exit 5), never a silent no-op."""

import json

import pytest
import torch
from typer.testing import CliRunner
from xdsl.context import Context

from coopt.cli.main import app
from coopt.codegen.input_bounds import derive_input_bounds
from coopt.codegen.program import forward_function
from coopt.errors import ConfigError
from coopt.frontend.capture import capture
from coopt.frontend.importer import import_program
from coopt.ir.summary import symbol_table
from coopt.passes.chunked_prefill import CHUNK_ATTR, ChunkedPrefill, fit_example_inputs, prefill_chunk, prompt_length_symbol
from coopt.passes.registry import parse_pipeline_text
from coopt.passes.stats import collect_counters

VOCAB, DIM, MAX_SEQ = 32, 8, 64


class Step(torch.nn.Module):
    """A decoder step forward(tokens [1, T], positions [T]) -> [1, T, V] writing a cache."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.out = torch.nn.Linear(DIM, VOCAB)
        self.register_buffer("cache", torch.zeros(1, 1, MAX_SEQ, DIM))

    def forward(self, tokens, positions):
        x = self.embed(tokens)
        self.cache[:, :, positions] = x[:, None]
        return self.out(x + self.cache[:, 0, positions])


def import_step(length: int = 24, dynamic: bool = True):
    inputs = (torch.randint(0, VOCAB, (1, length)), torch.arange(length))
    shapes = None
    if dynamic:
        t = torch.export.Dim("prompt_length", min=2, max=MAX_SEQ)
        shapes = ({1: t}, {0: t})
    return import_program(capture(Step().eval(), inputs, shapes), inputs).module, inputs


def run(module, pipeline: str):
    with collect_counters() as counters:
        for compiler_pass in parse_pipeline_text(pipeline):
            compiler_pass.apply(Context(allow_unregistered=True), module)
            module.verify()
    return dict(counters)


def test_the_pass_narrows_the_prompt_length_and_records_the_chunk():
    module, inputs = import_step(length=24)
    symbol = prompt_length_symbol(module)
    assert symbol is not None and symbol_table(module)[symbol][:2] == [2, MAX_SEQ]
    counters = run(module, "chunked-prefill{chunk=16}")
    assert counters["chunked_prefill.narrowed"] == 1
    assert symbol_table(module)[symbol] == [2, 16, 16]  # the example (24) is cut to the chunk too
    assert prefill_chunk(module) == 16 and CHUNK_ATTR in module.attributes
    # DECODER reads the narrowed range and the chunk
    fn = forward_function(module)
    decoder = derive_input_bounds(module, fn, symbol_table(module)).decoder
    assert decoder["length"] == [2, 16] and decoder["prefill_chunk"] == 16
    # the build checks its program on the first chunk of the example
    tokens, positions = fit_example_inputs(module, inputs)
    assert torch.equal(tokens, inputs[0][:, :16]) and torch.equal(positions, torch.arange(16))


def test_a_chunk_above_the_exported_maximum_changes_no_range():
    module, _ = import_step()
    symbol = prompt_length_symbol(module)
    counters = run(module, "chunked-prefill{chunk=128}")
    assert counters["chunked_prefill.within_chunk"] == 1 and symbol_table(module)[symbol][:2] == [2, MAX_SEQ]
    assert prefill_chunk(module) == 128


def test_without_a_dynamic_prompt_length_it_is_a_pipeline_error():
    module, _ = import_step(length=4, dynamic=False)
    assert prompt_length_symbol(module) is None
    with pytest.raises(ConfigError, match="no dynamic prompt length to chunk"):
        run(module, "chunked-prefill{chunk=16}")
    mlp = torch.nn.Linear(4, 4)
    x = (torch.randn(3, 4),)
    module = import_program(capture(mlp, x, ({0: torch.export.Dim("batch", min=1, max=8)},)), x).module
    with pytest.raises(ConfigError, match="no dynamic prompt length"):
        run(module, "chunked-prefill")


def test_pipeline_text_parses_the_chunk_and_rejects_bad_ones():
    (default,) = parse_pipeline_text("chunked-prefill")
    assert isinstance(default, ChunkedPrefill) and default.chunk == 512 and not default.lossy
    assert parse_pipeline_text("raise-patterns,chunked-prefill{chunk=32}")[1].chunk == 32
    for bad in ("8", "17", "100"):
        with pytest.raises(ConfigError, match="power of two >= 16"):
            parse_pipeline_text(f"chunked-prefill{{chunk={bad}}}")
    with pytest.raises(ConfigError, match="unknown knob 'size'"):
        parse_pipeline_text("chunked-prefill{size=16}")





@pytest.mark.parametrize("chunk, message", [("16", "no entry point of the model has a dynamic prompt length"),
                                             ("24", "power of two >= 16")])
def test_cli_prefill_chunk_errors_exit_5(tmp_path, plain_model_file, chunk, message):
    result = CliRunner().invoke(app, ["build", str(plain_model_file), "-o", str(tmp_path / "out"), "-q", "--prefill-chunk", chunk])
    assert result.exit_code == 5, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
