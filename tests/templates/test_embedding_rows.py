"""Template family "embedding_rows": the gathered rows bit for bit, h * g rounded as torch rounds
it, the chunk sums of squares against torch's, on a width that is no power of two (the last
block's chunks masked) and on a decode step's [B, 1] ids; what the family refuses."""

from __future__ import annotations

import pytest
import torch
from template_helpers import run_candidate

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.embedding_rows import EmbeddingRowsFamily

FAMILY = EmbeddingRowsFamily()


def region(vocab, width, ids_shape, chunk, dtype="bfloat16", ids_dtype="int64"):
    outputs = (TensorSpec((*ids_shape, width), dtype), TensorSpec((*ids_shape, width), dtype),
               TensorSpec((width // chunk, int(torch.Size(ids_shape).numel())), "float32"))
    return RegionSummary("emb", "embedding_rows",
                         inputs=(TensorSpec((vocab, width), dtype), TensorSpec(tuple(ids_shape), ids_dtype), TensorSpec((width,), dtype)),
                         outputs=outputs,
                         attrs={"row_squares": {"chunk": chunk, "weight_input": 2, "output": 0},
                                "index_input": 1, "index_bound": [0, 0]})


@pytest.mark.parametrize(("width", "chunk", "ids_shape", "ids_dtype"),
                         [(96, 32, (5, 1), "int64"), (256, 64, (3,), "int32"), (4096, 64, (2, 1), "int64")])
def test_every_point_matches_torch(load_candidate, width, chunk, ids_shape, ids_dtype):
    summary = region(40, width, ids_shape, chunk, ids_dtype=ids_dtype)
    gen = torch.Generator().manual_seed(width)
    table = torch.randn(40, width, generator=gen).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(width, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, 40, ids_shape, generator=gen).to(getattr(torch, ids_dtype))
    ids.view(-1)[0], ids.view(-1)[-1] = 39, 0  # the table's last row and its first
    want = table[ids]
    rows = want.float().reshape(-1, width // chunk, chunk)
    points = FAMILY.legal_points(summary, H200)
    assert points
    for params in points:
        h, hg, sq = (t.cpu() for t in run_candidate(FAMILY, H200, load_candidate, summary, params, [table, ids, g]))
        assert torch.equal(h, want)
        if torch.cuda.is_available():
            assert torch.equal(hg, want * g)  # torch's bf16 product: computed in fp32, rounded once
        else:  # Triton's interpreter truncates to bf16 (../shared/TRITON-INTERPRETER.md): 1 ulp
            torch.testing.assert_close(hg.float(), (want * g).float(), rtol=2 ** -7, atol=0)
        assert sq.shape == (width // chunk, ids.numel())
        torch.testing.assert_close(sq, (rows * rows).sum(-1).T, rtol=1e-5, atol=1e-5)


def test_strided_ids_are_read_through_their_stride(load_candidate):
    """[B, 1] ids sliced out of a wider tensor: reshape(-1) is then a view of stride 2."""
    summary = region(40, 64, (5, 1), 32)
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    g = torch.ones(64, dtype=torch.bfloat16)
    ids = torch.randint(0, 40, (5, 2), generator=gen)[:, :1]
    assert ids.reshape(-1).stride(0) == 2
    h, _, _ = run_candidate(FAMILY, H200, load_candidate, summary, {"num_warps": 1}, [table, ids, g])
    assert torch.equal(h.cpu(), table[ids])


def test_refused_regions_and_points():
    assert FAMILY.matches(region(40, 96, (5, 1), 32))
    assert not FAMILY.matches(region(40, 96, (5, 1), 64))  # 96 columns are no whole number of 64-column chunks
    assert not FAMILY.matches(region(40, 96, (5, 1), 48))  # a chunk must be a power of two (a block holds whole chunks)
    floats = region(40, 96, (5, 1), 32)
    floats = RegionSummary(floats.name, floats.family, (floats.inputs[0], TensorSpec((5, 1), "float32"), floats.inputs[2]),
                           floats.outputs, floats.attrs)
    assert not FAMILY.matches(floats)
    wide = region(40, 4096, (2, 1), 64)
    assert FAMILY.check(wide, {"num_warps": 1}, H200) == "one row of 4096 is over 64 elements per thread with num_warps=1"
    assert FAMILY.check(wide, {"num_warps": 4}, H200) is None
