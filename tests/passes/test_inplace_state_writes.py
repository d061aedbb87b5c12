"""inplace-state-writes: cache writes become in-place updates, and the built model keeps the
buffer semantics of the original (state after several calls, values returned)."""

import torch
from pass_helpers import beside_eager, run_pipeline

import coopt
from coopt.ir.dialect import StateUpdateOp, StateWriteOp


class Cache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 8, 4))
        self.register_buffer("v", torch.zeros(1, 2, 8, 4))
        self.register_buffer("s", torch.zeros(2, 8))

    def forward(self, x, pos):
        self.k[:, :, pos] = x
        self.v.index_copy_(2, pos, x * 2)
        self.s[:, :1] = x[0, :, :, 0]
        return self.k.sum(-1) + self.v.sum(-1) + self.s.sum()


def test_writes_become_in_place_updates():
    module, counters = run_pipeline(Cache(), [torch.randn(1, 2, 1, 4), torch.tensor([3])], "inplace-state-writes")
    ops = list(module.walk())
    assert not [o for o in ops if isinstance(o, StateWriteOp)]
    # index_copy_ (transformers' StaticCache) is written as the index_put_ the cache passes read
    updates = {o.ref.data: (o.target.data, o.call["args"][1]) for o in ops if isinstance(o, StateUpdateOp)}
    assert updates["v"] == ("aten.index_put_.default", [None, None, {"$t": 1}])
    assert updates["k"][0] == "aten.index_put_.default" and updates["s"][0] == "coopt.slice_copy_"
    assert counters["inplace.index_put"] == counters["inplace.index_copy"] == counters["inplace.slice_scatter"] == 1


class IndexCopies(torch.nn.Module):
    """index_copy_ on another dim, and on a negative one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rows", torch.zeros(6, 3))
        self.register_buffer("cols", torch.zeros(2, 5, 3))

    def forward(self, x, pos):
        self.rows.index_copy_(0, pos, x[:, 0])
        self.cols.index_copy_(-2, pos, x.transpose(0, 1).reshape(2, -1, 3)[:, : len(pos)])
        return self.rows.sum() + self.cols.sum()


def test_index_copy_on_any_dim_writes_the_same_rows(tmp_path):
    x, pos = torch.randn(2, 2, 3), torch.tensor([4, 1])
    module, _ = run_pipeline(IndexCopies(), [x, pos], "inplace-state-writes")
    indices = sorted(str(o.call["args"][1]) for o in module.walk() if isinstance(o, StateUpdateOp))
    assert indices == ["[None, {'$t': 1}]", "[{'$t': 1}]"]
    original = IndexCopies()
    coopt.Pipeline(top_k=1).build(IndexCopies(), (x, pos), tmp_path / "out")
    built = coopt.load(tmp_path / "out")
    for step in [(torch.randn(2, 2, 3), torch.tensor([0, 4])), (torch.randn(2, 2, 3), torch.tensor([3, 2]))]:
        torch.testing.assert_close(beside_eager(built)(*step), original(*step))
    torch.testing.assert_close(built.w_rows.cpu(), original.rows)
    torch.testing.assert_close(built.w_cols.cpu(), original.cols)


class ReadsOldValueAfterWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(4, 3))

    def forward(self, x):
        old = self.k.clone()
        self.k[1] = x
        return old * 2  # reads the value from before the write: must stay functional


def test_a_later_read_of_the_old_value_keeps_the_functional_form():
    module, counters = run_pipeline(ReadsOldValueAfterWrite(), [torch.randn(3)], "inplace-state-writes")
    assert not counters
    assert [o for o in module.walk() if isinstance(o, StateWriteOp)]


def test_built_model_matches_the_original_over_several_steps(tmp_path):
    original, steps = Cache(), [(torch.randn(1, 2, 1, 4), torch.tensor([p])) for p in (0, 5, 7)]
    coopt.Pipeline(top_k=1).build(Cache(), steps[0], tmp_path / "out")
    built = coopt.load(tmp_path / "out")
    for x, pos in steps:
        torch.testing.assert_close(beside_eager(built)(x, pos), original(x, pos))
    torch.testing.assert_close(built.w_k.cpu(), original.k)
    torch.testing.assert_close(built.w_s.cpu(), original.s)



class BatchRows(torch.nn.Module):
    """A cache of 4 sequences written for the first B of them (B dynamic): export gives
    slice_scatter(k, index_put(k[:B], [None, None, pos], x), 0, 0, B)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(4, 2, 8, 4))

    def forward(self, x, pos):
        self.k[: x.shape[0], :, pos] = x
        return self.k[: x.shape[0]].sum(-1)


BATCH_ROWS_SHAPES = ({0: torch.export.Dim("batch", min=1, max=4)}, None)


def test_a_dynamic_batch_writes_its_rows_through_the_slice_view():
    inputs = [torch.randn(2, 2, 1, 4), torch.tensor([3])]
    module, counters = run_pipeline(BatchRows(), inputs, "inplace-state-writes", dynamic_shapes=BATCH_ROWS_SHAPES)
    ops = list(module.walk())
    updates = [o for o in ops if isinstance(o, StateUpdateOp)]
    # one in-place index_put_ on k[:B] (no functional copy of the rows, no copy back)
    assert [o.target.data for o in updates] == ["aten.index_put_.default"] and counters["inplace.index_put_slice"] == 1
    assert updates[0].inputs[0].owner.target.data == "aten.slice.Tensor"
    assert not [o for o in ops if getattr(o, "target", None) is not None and o.target.data in (
        "aten.index_put.default", "aten.slice_scatter.default")]


def test_a_dynamic_batch_build_keeps_the_buffer_semantics(tmp_path):
    original, out = BatchRows(), tmp_path / "out"
    coopt.Pipeline(top_k=1).build(BatchRows(), (torch.randn(2, 2, 1, 4), torch.tensor([3])), out,
                                  dynamic_shapes=BATCH_ROWS_SHAPES)
    program = (out / "program.py").read_text()
    assert "index_put_" in program and ".copy_(" not in program
    built = coopt.load(out)
    for rows, pos in ((2, 0), (4, 5), (1, 7), (3, 5)):  # rows past B keep what they held
        x = torch.randn(rows, 2, 1, 4)
        torch.testing.assert_close(beside_eager(built)(x, torch.tensor([pos])), original(x, torch.tensor([pos])))
        torch.testing.assert_close(built.w_k.cpu(), original.k)


class SnapshotBuffer(torch.nn.Module):
    """A buffer takes a copy of a cache row, then the cache row is written: the copy is the row's
    value from before the write, read through a view of the cache."""

    def __init__(self):
        super().__init__()
        self.register_buffer("prev", torch.zeros(4))
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x, pos):
        self.prev.copy_(self.cache[3])
        self.cache.index_copy_(0, pos, x)
        return self.prev * 2.0


def test_a_view_read_after_the_write_keeps_the_functional_form(tmp_path):
    _, counters = run_pipeline(SnapshotBuffer(), [torch.randn(1, 4), torch.tensor([0])], "inplace-state-writes")
    assert not counters["inplace.index_copy"]
    coopt.Pipeline(top_k=1).build(SnapshotBuffer(), (torch.randn(1, 4), torch.tensor([0])), tmp_path / "out")
    built, eager = coopt.load(tmp_path / "out"), SnapshotBuffer()
    for _, buffer in built.named_buffers():
        buffer.zero_()
    for pos in (3, 3):
        x = torch.randn(1, 4)
        torch.testing.assert_close(beside_eager(built)(x, torch.tensor([pos])), eager(x, torch.tensor([pos])))
    torch.testing.assert_close(built.w_prev.cpu(), eager.prev)
