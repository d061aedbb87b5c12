"""verify_candidate on plain-torch and Triton (interpreter) candidates."""

from __future__ import annotations

import json

import pytest
from verify_helpers import MUL_ADD_REFERENCE, matrix_region, vector_region, write_module, ODD_TAIL_BUG

from coopt.verify.runner import verify_candidate

CORRECT = MUL_ADD_REFERENCE


RAISES = """
    def run(x, y):
        raise NotImplementedError("BLOCK must divide n")
"""

NAN_OUTPUT = """
    def run(x, y):
        out = x * y + 1.0
        out[0] = float("nan")
        return (out,)
"""

RETURNS_TENSOR = """
    def run(x, y):
        return x * y + 1.0
"""


def _verify(tmp_path, reference, source, region=None, **kwargs):
    candidate = write_module(tmp_path / "kernels", "candidate", source)
    return verify_candidate(region or vector_region(), reference, candidate, **kwargs)


def test_correct_candidate_passes(tmp_path, mul_add_reference):
    result = _verify(tmp_path, mul_add_reference, CORRECT)
    assert result.ok and result.failure is None and result.repro is None
    assert result.examples >= 10
    assert result.max_rel_err < 1e-6


def test_odd_tail_bug_is_caught_and_shrunk_to_the_smallest_odd_size(tmp_path,
                                                                    mul_add_reference):
    result = _verify(tmp_path, mul_add_reference, ODD_TAIL_BUG, region=vector_region(lo=2))
    assert not result.ok
    assert result.falsifying_example == {"dims": {"n": 3}, "seed": 0, "magnitude": 1.0}
    assert "[dims n=3, seed 0, magnitude 1]" in result.failure
    assert "worst at (2,)" in result.failure


def test_bug_only_for_a_single_row_reports_rows_1(tmp_path):
    reference = write_module(tmp_path, "reference", """
        import torch

        def run(x):
            return (torch.softmax(x, dim=-1),)
    """)
    result = _verify(tmp_path, reference, """
        import torch

        def run(x):
            if x.shape[0] == 1:  # a "single row" fast path with the wrong axis
                return (torch.softmax(x, dim=0),)
            return (torch.softmax(x, dim=-1),)
    """, region=matrix_region())
    assert not result.ok
    assert result.falsifying_example["dims"]["rows"] == 1
    assert result.falsifying_example["dims"]["cols"] == 2  # cols=1 softmax is 1 either way


def test_candidate_exception_is_a_failure_with_its_message(tmp_path, mul_add_reference):
    result = _verify(tmp_path, mul_add_reference, RAISES)
    assert not result.ok
    assert result.failure.startswith(
        "candidate raised NotImplementedError: BLOCK must divide n [dims n=1")


def test_import_error_and_missing_run_are_failures(tmp_path, mul_add_reference):
    broken = _verify(tmp_path, mul_add_reference, "import no_such_module_xyz\n")
    assert broken.failure == ("candidate failed to import: ModuleNotFoundError: "
                              "No module named 'no_such_module_xyz'")
    no_run = _verify(tmp_path, mul_add_reference, "def forward(x, y):\n    return x\n")
    assert no_run.failure == "candidate candidate.py defines no run()"


def test_nan_output_fails(tmp_path, mul_add_reference):
    result = _verify(tmp_path, mul_add_reference, NAN_OUTPUT)
    assert not result.ok and "non-finite mismatch" in result.failure


def test_bare_tensor_instead_of_tuple_fails(tmp_path, mul_add_reference):
    result = _verify(tmp_path, mul_add_reference, RETURNS_TENSOR)
    assert "run() returned Tensor, expected a tuple" in result.failure


def test_bf16_equal_to_eager_passes_and_ten_percent_off_fails(tmp_path):
    reference = write_module(tmp_path, "reference", """
        import torch

        def run(x, y):
            return (torch.nn.functional.silu(x) * y,)
    """)
    region = vector_region("bfloat16")
    eager = _verify(tmp_path, reference, """
        import torch

        def run(x, y):
            return (torch.nn.functional.silu(x) * y,)
    """, region=region)
    assert eager.ok, eager.failure
    fused_fp32 = _verify(tmp_path, reference, """
        import torch

        def run(x, y):
            return ((torch.nn.functional.silu(x.float()) * y.float()).to(torch.bfloat16),)
    """, region=region)
    assert fused_fp32.ok, fused_fp32.failure
    off = _verify(tmp_path, reference, """
        import torch

        def run(x, y):
            return ((torch.nn.functional.silu(x.float()) * y.float() * 1.1).to(torch.bfloat16),)
    """, region=region)
    assert not off.ok and "bfloat16 floor" in off.failure


def test_same_seed_same_examples(tmp_path, mul_add_reference):
    log = tmp_path / "log.jsonl"
    recorder = f"""
        import json

        def run(x, y):
            with open({str(log)!r}, "a") as f:
                f.write(json.dumps([list(x.shape), float(x.sum())]) + "\\n")
            return (x * y + 1.0,)
    """

    def examples_seen(seed):
        log.write_text("")
        assert _verify(tmp_path, mul_add_reference, recorder, seed=seed).ok
        return [json.loads(line) for line in log.read_text().splitlines()]

    first = examples_seen(seed=7)
    assert first == examples_seen(seed=7)
    assert first != examples_seen(seed=8)


# -- real Triton kernels, in the interpreter on CPU -----------------------------------------

TRITON_MUL_ADD = """
    import torch
    import triton
    import triton.language as tl


    @triton.jit
    def _mul_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < {limit}
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, (x * y + 1.0).to(out_ptr.dtype.element_ty), mask=mask)


    def run(x, y):
        out = torch.zeros_like(x)
        n = x.numel()
        _mul_add[(triton.cdiv(n, 16),)](x, y, out, n, BLOCK=16)
        return (out,)
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_in_the_interpreter_passes(tmp_path, mul_add_reference, dtype):
    # bf16: the interpreter truncates fp32 -> bf16 (1 ulp off torch), within the bf16 rule.
    result = _verify(tmp_path, mul_add_reference, TRITON_MUL_ADD.format(limit="n"),
                     region=vector_region(dtype))
    assert result.ok, result.failure


def test_triton_kernel_with_odd_tail_bug_is_shrunk(tmp_path, mul_add_reference):
    buggy = TRITON_MUL_ADD.format(limit="n - n % 2")  # drops the last element of odd n
    result = _verify(tmp_path, mul_add_reference, buggy, region=vector_region(lo=2))
    assert not result.ok
    assert result.falsifying_example["dims"] == {"n": 3}


def test_after_a_lost_cuda_context_no_further_examples_run(tmp_path, mul_add_reference,
                                                          monkeypatch):
    # Simulated on CPU: after the first failure the "context" is gone, so the first failing
    # example is reported as is instead of being shrunk through examples that cannot run.
    from coopt.verify import runner

    monkeypatch.setattr(runner, "_cuda_context_lost", lambda device: True)
    result = _verify(tmp_path, mul_add_reference, RAISES)
    assert not result.ok
    assert result.failure.endswith("(CUDA context lost: no further examples run)")
    assert result.examples == 1


# An output that turns on the last bit of x: eager is exact on the drawn inputs, but one input
# ulp away (every element's last bit flipped) it is 1e-3 off, as far as the candidate.
LAST_BIT_REFERENCE = """
    import torch

    def run(x, y):
        return (x * y + 1e-3 * (x.float().view(torch.int32) & 1).to(x.dtype),)
"""
OTHER_LAST_BIT = """
    import torch

    def run(x, y):
        return (x * y + 1e-3 * (1 - (x.float().view(torch.int32) & 1)).to(x.dtype),)
"""


# Ill-conditioned at bf16: the output jumps by half on the last mantissa bit of bf16 x (bit 16
# of its fp32 form). Eager is exact on the drawn inputs; one bf16 ulp away every bit flips.
BF16_BIT_REFERENCE = """
    import torch

    def run(x, y):
        bit = ((x.float().view(torch.int32) >> 16) & 1).to(x.dtype)
        return (x * y * (1 + 0.5 * bit),)
"""
OTHER_BF16_BIT = """
    import torch

    def run(x, y):
        bit = ((x.float().view(torch.int32) >> 16) & 1).to(x.dtype)
        return (x * y * (1 + 0.5 * (1 - bit)),)
"""
def test_eager_one_bf16_ulp_away_bounds_a_bf16_candidate_where_the_example_is_ill_conditioned(tmp_path):
    # (that it gives no slack where eager one ulp away meets the floor: test_verify_tolerances.py)
    reference = write_module(tmp_path / "kernels", "reference", BF16_BIT_REFERENCE)
    result = _verify(tmp_path, reference, OTHER_BF16_BIT, region=vector_region("bfloat16"))
    assert result.ok, result.failure


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_one_input_ulp_away_bounds_fp32_candidates_only(tmp_path, dtype):
    # fp32 inputs: the candidate is within what eager gives one ulp away, and passes; bf16
    # inputs are not moved (their floor is already eager-sized), so the same candidate fails
    reference = write_module(tmp_path / "kernels", "reference", LAST_BIT_REFERENCE)
    result = _verify(tmp_path, reference, OTHER_LAST_BIT, region=vector_region(dtype))
    assert result.ok == (dtype == "float32"), result.failure
