"""Fusion passes: which regions form, with which family attributes."""

import torch
import torch.nn.functional as F

from pass_helpers import kernel_families, kernels, run_pipeline
from test_raise_patterns import ExplicitAttention, Lambda

x4 = torch.randn(2, 3, 16)


def test_linear_takes_its_activation_and_residual_epilogue():
    w, b = torch.randn(16, 16), torch.randn(16)
    model = Lambda(lambda m, x: x + F.relu(F.linear(x, m.w, m.b)), w=w, b=b)
    module, counters = run_pipeline(model, [x4])
    (kernel,) = kernels(module)
    attrs = kernel.family_attrs
    assert kernel.family.data == "matmul_epilogue"
    assert [fn for _, fn, _ in attrs["epilogue"]] == ["relu", "add"]
    assert attrs["has_bias"] and attrs["b_layout"] == "nk"
    assert counters["fuse.matmul_epilogue.epilogue_ops"] == 2


def test_epilogue_length_knob():
    w = torch.randn(16, 16)
    model = Lambda(lambda m, x: torch.tanh(F.relu(F.linear(x, m.w)) * 2.0) + 1.0, w=w)
    module, _ = run_pipeline(model, [x4], "raise-patterns,fuse-linear-epilogue{max-ops=1},fuse-elementwise")
    assert kernel_families(module) == ["matmul_epilogue", "elementwise"]
    assert len(kernels(module)[0].family_attrs["epilogue"]) == 1


def test_residual_norm_takes_the_add_when_the_sum_is_reused():
    w = torch.randn(16)
    reused = Lambda(lambda m, x, r: (lambda h: (F.rms_norm(h, (16,), m.w), h))(x + r), w=w)
    module, counters = run_pipeline(reused, [x4, x4.clone()])
    (kernel,) = kernels(module)
    assert kernel.family_attrs["residual"] is True and len(kernel.results) == 2
    assert counters["fuse.row_reduction.rms_norm+residual"] == 1
    # the sum used only by the norm: the add stays an elementwise region
    single = Lambda(lambda m, x, r: F.rms_norm(x + r, (16,), m.w), w=w)
    module, _ = run_pipeline(single, [x4, x4.clone()])
    assert kernel_families(module) == ["elementwise", "row_reduction"]


def test_elementwise_chain_with_broadcast_is_one_region():
    b = torch.randn(16)
    model = Lambda(lambda m, x: torch.sigmoid(x * 2.0 + m.b) * x, b=b)
    module, _ = run_pipeline(model, [x4])
    (kernel,) = kernels(module)
    assert kernel.family.data == "elementwise"
    assert [fn for _, fn, _ in kernel.family_attrs["program"]] == ["mul", "add", "sigmoid", "mul"]


def test_readers_of_one_value_share_a_kernel():
    # a rotary table's cos and sin of the same angles (each cast to bf16): one kernel reading the
    # angles once, two outputs; a reader of another shape stays apart
    model = Lambda(lambda m, x: (x.cos().to(torch.bfloat16), x.sin().to(torch.bfloat16), x.sum(-1).exp()))
    module, counters = run_pipeline(model, [x4])
    ew = [k for k in kernels(module) if k.family.data == "elementwise"]
    assert sorted(sorted(fn for _, fn, _ in k.family_attrs["program"]) for k in ew) == [
        ["cos", "sin", "to_bf16", "to_bf16"], ["exp"]]
    assert counters["fuse.elementwise"] == 2


def test_a_16_bit_value_widened_to_fp32_is_rounded_to_its_dtype_first():
    # (a + b).float() on bf16: inside the fp32 program the sum was never rounded to bf16, eager's
    # was; bf16 -> fp16 (two roundings) stays ATen
    a, b = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    module, _ = run_pipeline(Lambda(lambda m, a, b: (a + b).float() * 3), [a, b])
    (kernel,) = kernels(module)
    assert [fn for _, fn, _ in kernel.family_attrs["program"]] == ["add", "bf16_to_f32", "mul"]
    module, _ = run_pipeline(Lambda(lambda m, a: (a * 2).to(torch.float16)), [a])
    assert [fn for _, fn, _ in kernels(module)[0].family_attrs["program"]] == ["mul"]
    assert "aten._to_copy.default" in [op.target.data for op in module.walk() if hasattr(op, "target")]


def test_integer_positions_cast_to_fp32_fuse_with_the_angles():
    positions, inv = torch.arange(12).view(3, 4), torch.rand(8)
    module, _ = run_pipeline(Lambda(lambda m, p, f: p[..., None].float() * f), [positions, inv])
    (kernel,) = kernels(module)
    assert [fn for _, fn, _ in kernel.family_attrs["program"]] == ["to_f32", "mul"]
    assert kernel.inputs[0].type.element_type == module.body.block.first_op.body.block.args[0].type.element_type
    # to a 16-bit type an integer would round twice through fp32 (past 2^24): that cast stays ATen
    module, _ = run_pipeline(Lambda(lambda m, p, f: p[..., None].to(torch.bfloat16) * f.bfloat16()), [positions, inv])
    assert "aten._to_copy.default" in [op.target.data for op in module.walk() if hasattr(op, "target")]


def test_elementwise_max_ops_splits_chains():
    model = Lambda(lambda m, x: torch.exp(torch.tanh(torch.relu(x) + 1.0)))
    module, _ = run_pipeline(model, [x4], "raise-patterns,fuse-elementwise{max-ops=2}")
    assert kernel_families(module) == ["elementwise", "elementwise"]


def test_attention_region_has_gqa_attrs():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    model = Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    module, counters = run_pipeline(model, [q, k, k.clone()])
    (kernel,) = kernels(module)
    assert kernel.family_attrs == {"causal": True, "scale": 0.25, "num_heads": 4, "num_kv_heads": 2}
    assert counters["fuse.attention.gqa"] == 1


def test_explicit_attention_becomes_one_region_and_the_mask_disappears():
    q = torch.randn(2, 4, 8, 16)
    module, _ = run_pipeline(ExplicitAttention(True), [q, q, q])
    assert kernel_families(module) == ["attention"]
    assert "mask" not in str(module)  # the causal buffer is no longer read


def test_unfusable_ops_stay_outside_kernels():
    model = Lambda(lambda m, x: torch.cumsum(x, -1).relu())
    module, _ = run_pipeline(model, [x4])
    assert kernel_families(module) == ["elementwise"]
    assert "aten.cumsum.default" in str(module)
