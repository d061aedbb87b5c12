"""culprit_groups finds the kernels that break the end-to-end agreement, alone or only together,
and keeps every other kernel."""

from __future__ import annotations

import pytest

from coopt.verify.bisect import ReferencesDisagree, culprit_groups

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
