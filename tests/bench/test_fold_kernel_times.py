"""bench/fold_kernel_times.py without a GPU: the regions it times are the ones the families
accept (the folded attention, its kv_write, the plain attention), at the points it times."""

from __future__ import annotations

import pytest
from attention_sweep import CASES, make_region
from fold_kernel_times import folded_region, write_region

from coopt.targets import H200
from coopt.templates.decode_attention import DecodeAttentionFamily
from coopt.templates.kv_write import KvWriteFamily


@pytest.mark.parametrize("case", ["b1-32768-fp8", "b1-2048-fp8", "b1-2048-rope"])
def test_regions_are_what_the_families_take(case):
    batch, length, cache, fp8 = CASES[case][:4]
    attention = make_region(batch, length, cache, fp8, rope=True)
    folded, write = folded_region(attention), write_region(attention)
    assert KvWriteFamily().matches(write) and write.attrs["quant"] == ("per-head" if fp8 else "none")
    family = DecodeAttentionFamily()
    assert family.matches(folded) and family.matches(attention)
    for split in (16, 32):
        params = {"BLOCK_N": 128, "SPLIT_KV": split, "USE_DOT": True, "num_warps": 4, "num_stages": 3, "TILE_FP16": fp8}
        assert family.check(folded, params, H200) is None and family.check(attention, params, H200) is None
        source = family.render(folded, params)
        assert ("_quantize(k_new, k_scale)" in source) == fp8 and "if writes_new:" in source
