"""GraphedStep: replays a captured step on the GPU; on the CPU it is the plain module."""

import pytest
import torch

from coopt.runtime.cuda_graph import GraphedStep


class Step(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x):
        self.state.add_(x)
        return self.state * 2


def test_without_a_gpu_it_calls_the_module():
    step = GraphedStep(Step(), (torch.ones(4),))
    assert not step.enabled
    torch.testing.assert_close(step(torch.ones(4)), torch.full((4,), 2.0))


@pytest.mark.gpu
def test_replay_matches_eager_and_rejects_other_shapes():
    eager, graphed_module = Step().cuda(), Step().cuda()
    x = torch.randn(4, device="cuda")
    step = GraphedStep(graphed_module, (x,), warmup=1)
    eager(x)  # the one warm-up run wrote the state once (capture records, it does not run)
    for _ in range(3):
        y = torch.randn(4, device="cuda")
        torch.testing.assert_close(step(y).clone(), eager(y))
    with pytest.raises(ValueError, match="shape"):
        step(torch.randn(5, device="cuda"))
