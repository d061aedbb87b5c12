"""GraphedStep: replays a captured step on the GPU; on the CPU it is the plain module. Either way
a module's `check_call` (every coopt build has one) vets each call's inputs before they reach
the graph or the module."""

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


class CheckedStep(Step):
    """A step whose inputs must lie in [0, 10), as a built model's position into its cache."""

    def __init__(self):
        super().__init__()
        self.checked = 0

    def check_call(self, x):
        self.checked += 1
        largest = float(x.max())
        if largest >= 10:
            raise ValueError(f"x: holds {largest:g}, outside [0, 10)")


def test_without_a_gpu_it_calls_the_module():
    step = GraphedStep(Step(), (torch.ones(4),))
    assert not step.enabled and step.check_call is None  # a module without check_call works as before
    torch.testing.assert_close(step(torch.ones(4)), torch.full((4,), 2.0))


def test_without_a_gpu_it_checks_values_before_calling_the_module():
    module = CheckedStep()
    step = GraphedStep(module, (torch.ones(4),))
    assert not step.enabled
    torch.testing.assert_close(step(torch.ones(4)), torch.full((4,), 2.0))
    with pytest.raises(ValueError, match=r"x: holds 12, outside \[0, 10\)"):
        step(torch.full((4,), 12.0))
    torch.testing.assert_close(module.state, torch.ones(4))  # the refused call wrote nothing
    assert module.checked == 2


def test_check_false_leaves_checking_to_the_caller():
    module = CheckedStep()
    step = GraphedStep(module, (torch.ones(4),), check=False)
    step(torch.full((4,), 12.0))
    assert module.checked == 0


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


@pytest.mark.gpu
def test_replay_refuses_bad_values_before_copying_them():
    module = CheckedStep().cuda()
    x = torch.ones(4, device="cuda")
    step = GraphedStep(module, (x,), warmup=1)
    state = module.state.clone()
    with pytest.raises(ValueError, match=r"x: holds 12, outside \[0, 10\)"):
        step(torch.full((4,), 12.0, device="cuda"))
    torch.testing.assert_close(step.static_inputs[0], x)  # nothing copied, nothing replayed
    torch.testing.assert_close(module.state, state)
    torch.testing.assert_close(step(torch.full((4,), 2.0, device="cuda")).clone(), (state + 2) * 2)
