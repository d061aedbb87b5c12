"""bench/cuda_attention_probe.py: the CUDA cluster attention's source compiles for sm_90 without
spilling (with the CUDA toolkit's nvcc, where the machine has one: the probe itself compiles it
with NVRTC on the GPU machine), its shared memory fits an H200 block at every point the probe
times, and on a GPU it computes the attention over 1 .. S valid keys, blocks without keys
included, and its folded form (the query's rope, the new K/V row written) the template's folded
step."""

from __future__ import annotations

import pytest
import torch
from cuda_attention_probe import ClusterAttention, render, shared_bytes

from coopt.targets import H200

POINTS = [(split, tile, stages) for split in (4, 8, 16) for tile in (32, 64, 128) for stages in (2, 3)]


def test_every_point_fits_a_block_of_shared_memory():
    assert all(shared_bytes(*p) <= H200.smem_per_block_bytes for p in POINTS)
    # the stages are what grows: three 64-key stages of K and V take 96 KiB
    assert shared_bytes(16, 64, 3) - shared_bytes(16, 64, 2) == 2 * 64 * 128 * 2


@pytest.mark.parametrize("point,fold", [((16, 64, 3), False), ((8, 32, 2), False), ((8, 128, 3), False), ((16, 64, 3), True)])
def test_the_source_compiles_for_hopper_without_spills(hopper_registers, point, fold):
    assert hopper_registers(render(*point, fold=fold)) * 256 <= 65536  # one block of eight warps an SM


@pytest.mark.gpu
@pytest.mark.parametrize("split,tile,stages", [(4, 64, 2), (8, 32, 3), (16, 64, 3), (8, 128, 2)])
def test_the_cluster_attention_matches_an_fp32_softmax(split, tile, stages):
    from attention_sweep import make_inputs, make_region, reference

    probe = ClusterAttention(split, tile, stages)
    for length in (1, 63, 64, 65, 1000, 2048, 4096):
        region = make_region(1, length, 4096, False)
        inputs = make_inputs(region, length, seed=length)
        out = torch.empty(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        expected = reference(region, *inputs).float()
        got = probe.run(*inputs, out).float()
        assert (got - expected).abs().max() <= 2e-2 * expected.abs().max(), (split, tile, stages, length)


@pytest.mark.gpu
@pytest.mark.parametrize("split,tile", [(8, 64), (16, 32)])
def test_the_folded_cluster_attention_matches_the_templates_folded_step(tmp_path, split, tile):
    """The query's rope and the new K/V row (K rotated) written by the block whose keys hold it,
    the row inside its first tile, at a tile's end, and the only key."""
    from attention_sweep import make_inputs, make_region
    from fold_kernel_times import folded_region

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.decode_attention import DecodeAttentionFamily

    probe = ClusterAttention(split, tile, 2, fold=True)
    family = DecodeAttentionFamily()
    for length in (1, 65, 64 * split, 2000):
        region = folded_region(make_region(1, length, 4096, False, rope=True))
        path = tmp_path / f"folded_{length}.py"
        path.write_text(family.render(region, {"BLOCK_N": 128, "SPLIT_KV": 8, "USE_DOT": True, "num_warps": 4,
                                               "num_stages": 3}))
        template = load_module_from_file(path).run
        gen = torch.Generator(device="cuda").manual_seed(length)
        inputs = [*make_inputs(region, length, seed=length), torch.tensor([length - 1], device="cuda"),
                  *(torch.randn(1, 8, 1, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in "kv")]
        done = [t.clone() for t in inputs]
        expected = template(*done)[2].float()
        mine = [t.clone() for t in inputs]
        out = torch.empty(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        q, k, v, lengths, cos, sin, position, k_new, v_new = mine
        got = probe.run(q, k, v, lengths, out, cos, sin, position, k_new, v_new).float()
        assert (got - expected).abs().max() <= 2e-2 * expected.abs().max(), (split, tile, length)
        for i in (1, 2):  # the new rows, bf16 apart at most by the rope's fp32 contraction
            torch.testing.assert_close(mine[i][0, :, length - 1], done[i][0, :, length - 1], atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(mine[i][0, :, :length - 1], done[i][0, :, :length - 1], atol=0, rtol=0)
