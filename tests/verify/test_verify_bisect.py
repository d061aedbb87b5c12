"""culprit_groups finds the kernels that break the end-to-end agreement, alone or only together,
and keeps every other kernel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import coopt.verify.bisect as bisect
from coopt.verify.bisect import ReferencesDisagree, culprit_groups, snapshot_buffers

GROUPS = ["norm", "qkv", "rope", "attn", "mlp"]


def recording(rule):
    calls = []

    def agrees(enabled):
        calls.append(set(enabled))
        return rule(enabled)

    return agrees, calls


def test_a_kernel_wrong_on_its_own_is_the_only_one_dropped():
    agrees, calls = recording(lambda enabled: "rope" not in enabled)
    assert culprit_groups(GROUPS, agrees) == ["rope"]
    assert calls[-1] == set(GROUPS) - {"rope"}  # the kept kernels were checked together
    assert len(calls) == 1 + len(GROUPS) + 1


def test_two_kernels_that_disagree_only_together_lose_the_later_one():
    agrees, _ = recording(lambda enabled: not {"qkv", "mlp"} <= enabled)
    assert culprit_groups(GROUPS, agrees) == ["mlp"]


def test_every_kernel_kept_when_each_agrees_and_all_agree():
    agrees, calls = recording(lambda enabled: True)
    assert culprit_groups(GROUPS, agrees) == []
    assert len(calls) == 1 + len(GROUPS) + 1


def test_references_that_disagree_are_not_blamed_on_kernels():
    agrees, calls = recording(lambda enabled: False)
    with pytest.raises(ReferencesDisagree):
        culprit_groups(GROUPS, agrees)
    assert calls == [set()]


class _Cache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.arange(6.0))
        self.register_buffer("v", torch.ones(2, 3, dtype=torch.bfloat16))


@pytest.mark.parametrize("home", [None, "cpu"])
def test_a_snapshot_puts_the_buffers_back_on_the_device_or_from_the_host(monkeypatch, home):
    monkeypatch.setattr(bisect, "_snapshot_home", lambda buffers, reserve: home)
    module = _Cache()
    restore = snapshot_buffers(module)
    module.k.add_(5)  # in place, as a decode step writes its cache
    module.v.zero_()
    restore()
    assert torch.equal(module.k, torch.arange(6.0)) and torch.equal(module.v, torch.ones(2, 3, dtype=torch.bfloat16))


def _cuda_like(nbytes):
    return SimpleNamespace(device=SimpleNamespace(type="cuda"), numel=lambda: nbytes, element_size=lambda: 1)


def test_a_snapshot_larger_than_its_share_of_free_device_memory_is_held_on_the_host(monkeypatch):
    import coopt.verify.end_to_end as e2e

    monkeypatch.setattr(e2e, "device_free_bytes", lambda device: 1000)
    share = int(bisect.DEVICE_SNAPSHOT_SHARE * 1000)
    assert bisect._snapshot_home([_cuda_like(share)]) is None
    assert bisect._snapshot_home([_cuda_like(share // 2), _cuda_like(share // 2 + 1)]) == "cpu"
    assert bisect._snapshot_home([torch.zeros(10**6)]) is None  # host buffers: copied beside themselves
    # what is still to be loaded beside the snapshot (the check's build) is not the snapshot's
    assert bisect._snapshot_home([_cuda_like(share // 2)], reserve=501) == "cpu"  # 125 > 0.25 x 499
    assert bisect._snapshot_home([_cuda_like(share // 2)], reserve=500) is None
