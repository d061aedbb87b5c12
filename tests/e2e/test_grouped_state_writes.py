"""A step that writes several state buffers (transformers' StaticCache: a cumulative_length a
layer) writes them in one torch._foreach_copy_ (one launch on a GPU, not one a buffer), and the
buffers hold what eager's hold after every step (a cast included)."""

import torch

import coopt


class Counters(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("length_0", torch.zeros(1, dtype=torch.int64))
        self.register_buffer("length_1", torch.zeros(1, dtype=torch.int64))
        self.register_buffer("seen", torch.zeros(3))
        self.register_buffer("total", torch.zeros(3, dtype=torch.float64))

    def forward(self, x, position):
        self.length_0.copy_(position + 1)
        self.length_1.copy_(position + 1)
        self.seen.copy_(x * 2)
        self.total.copy_(self.total + x)  # float64 buffer, float32 value: copy_ casts
        return x + self.seen


def test_state_writes_are_one_foreach_copy_and_match_eager(tmp_path):
    def step(pos):
        return torch.randn(3, generator=torch.Generator().manual_seed(pos)), torch.tensor([pos])

    eager = Counters()
    coopt.Pipeline("inplace-state-writes", top_k=1).build(Counters(), step(0), tmp_path / "out")
    program = (tmp_path / "out" / "program.py").read_text()
    assert program.count("torch._foreach_copy_(") == 1
    assert ".copy_(" not in program.replace("torch._foreach_copy_(", "")
    built = coopt.load(tmp_path / "out", device="cpu")
    for pos in range(3):
        torch.testing.assert_close(built(*step(pos)), eager(*step(pos)))
        for name in ("length_0", "length_1", "seen", "total"):
            torch.testing.assert_close(built.state_tensor(name), getattr(eager, name), msg=name)
