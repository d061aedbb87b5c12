"""generate() and the call-time errors of a built decoder, on the tiny Llama.

Two builds, each made once per module (about 15 s and 25 s in Triton's interpreter; one call of
either takes about 0.3 s here): `static` is examples/llama/model.py's decode step alone (one decode
token of one sequence per call, COOPT_LLAMA_PREFILL=0: the prompt goes through token by token); `dynamic` is
dynamic_llama.py (batch 1..4 and length 1..64 dynamic: the prompt is one call). The eager
reference is the same model file's model, float32, with the same seeds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import coopt
from coopt.frontend.model_file import load_model_file
from llama_helpers import DEVICE, MODEL_PATH

DYNAMIC_PATH = Path(__file__).resolve().parent / "dynamic_llama.py"
NEW_TOKENS = 16
# call counting sees every step only without CUDA graphs (a replay runs no forward)
PLAIN = {"cuda_graphs": False}


def tensor(data, **options) -> torch.Tensor:
    return torch.tensor(data, device=DEVICE, **options)


def _build(path, out, monkeypatch, **env):
    for name in [n for n in os.environ if n.startswith("COOPT_LLAMA_") or n == "COOPT_EXAMPLE_DTYPE"]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = coopt.build(path, out, top_k=1)
    assert result.e2e["ok"], result.e2e
    eager = load_model_file(path)
    eager.model.to(DEVICE)
    return coopt.load(out), eager


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        # the decode step alone (no prefill entry point: test_llama_build covers that one)
        return _build(MODEL_PATH, tmp_path_factory.mktemp("static") / "out", monkeypatch, COOPT_LLAMA_PREFILL="0")


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _build(DYNAMIC_PATH, tmp_path_factory.mktemp("dynamic") / "out", monkeypatch)


def program(built):
    """The generated program.py module of a loaded build (its INPUTS, INDEX_BOUNDS, ...)."""
    return sys.modules[type(built).__module__]


def caches(built) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in built.named_buffers() if name.endswith("_cache")}


def assert_caches_unchanged(built, before):
    for name, buffer in built.named_buffers():
        if name in before:
            assert torch.equal(buffer, before[name]), f"{name} changed"


class CallShapes:
    """Records the (tokens, positions) shapes of every forward call."""

    def __init__(self, built):
        self.shapes = []
        self.handle = built.register_forward_pre_hook(lambda _, args: self.shapes.append((tuple(args[0].shape), tuple(args[1].shape))))

    def __enter__(self):
        return self.shapes

    def __exit__(self, *exc):
        self.handle.remove()


# -- what the IR says about the inputs ------------------------------------------------------------


def test_bounds_and_decoder_contract_are_derived_from_the_ir(static, dynamic):
    static_program, dynamic_program = program(static[0]), program(dynamic[0])
    # positions index the KV cache's sequence dim (and the RoPE tables); tokens the embedding
    assert (1, 0, 128, "dim 2 (size 128) of the state buffer 'layers.0.attention.k_cache'") in static_program.INDEX_BOUNDS
    assert (0, 0, 256, "dim 0 (size 256) of the weight 'embed.weight'") in static_program.INDEX_BOUNDS
    assert static_program.SIZE_BOUNDS == []  # the batch is static: the shape check holds it
    assert static[0].decoder == {"tokens": 0, "positions": 1, "dtype": "int64", "max_seq": 128,
                                 "batch": [1, 1], "length": [1, 1], "token_range": [0, 256]}
    # k_cache[:batch] with a dynamic batch: the batch may not exceed the cache's 4 rows
    assert (0, 0, 4, "dim 0 (size 4) of the state buffer 'layers.0.attention.k_cache'") in dynamic_program.SIZE_BOUNDS
    assert dynamic[0].decoder["batch"] == [1, 4] and dynamic[0].decoder["length"] == [1, 64]
    assert dynamic[0].decoder["max_seq"] == 64


# -- generate ------------------------------------------------------------------------------------


def test_64_decode_steps_follow_eager_fp32_logits_and_top1(static):
    """Issue 3's end-to-end check on the tiny config: 64 teacher-forced decode steps, logits within
    the fp32 tolerance of eager and the same argmax at every step."""
    from coopt.verify.decode_agreement import decode_agreement

    built, eager = static
    tokens, position = eager.example_inputs
    start = int(position[0]) - 64  # the 64 steps end where the example step is, inside the cache
    result = decode_agreement(built, eager.model, tokens.to(DEVICE), start, 64)
    assert result.steps == 64
    assert result.max_abs_err < 1e-3, result
    assert result.top1_agreement == 1.0, result


def test_greedy_generate_of_the_decode_only_build_matches_eager(static, llama):
    built, eager = static
    prompt = tensor([[3, 17, 42, 9]])
    with CallShapes(built) as calls:
        tokens = coopt.generate(built, prompt, NEW_TOKENS, **PLAIN)
    expected = llama.generate_reference(eager.model, prompt, NEW_TOKENS)
    assert tokens.shape == (1, 4 + NEW_TOKENS)
    assert torch.equal(tokens, expected), f"{tokens.tolist()} != {expected.tolist()}"
    # a T = 1 build: the prompt goes in token by token, then one call per new token but the last
    assert calls == [((1, 1), (1,))] * (4 + NEW_TOKENS - 1)


def test_greedy_generate_of_the_dynamic_build_prefills_in_one_call(dynamic, llama):
    built, eager = dynamic
    prompt = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with CallShapes(built) as calls:
        tokens = built.generate(prompt, NEW_TOKENS, **PLAIN)
    expected = llama.generate_reference(eager.model, prompt, NEW_TOKENS)
    assert torch.equal(tokens, expected), f"{tokens.tolist()} != {expected.tolist()}"
    assert calls == [((3, 5), (5,))] + [((3, 1), (1,))] * (NEW_TOKENS - 1)


def test_a_separate_prefill_writing_the_same_cache(static, llama):
    """A decode-only build with an eager prefill whose cache buffers are the build's own."""
    built, eager = static
    model = load_model_file(MODEL_PATH).model.to(DEVICE)
    for i, layer in enumerate(model.layers):
        layer.attention.k_cache = getattr(built, f"w_layers_{i}_attention_k_cache")
        layer.attention.v_cache = getattr(built, f"w_layers_{i}_attention_v_cache")
    prompt = tensor([[11, 2, 250, 7, 7, 31]])
    with CallShapes(built) as calls:
        tokens = built.generate(prompt, 6, prefill=model, **PLAIN)
    assert torch.equal(tokens, llama.generate_reference(eager.model, prompt, 6))
    assert len(calls) == 5  # the prompt went to `prefill`


def test_sampling_is_reproducible_and_differs_from_greedy(dynamic):
    built, _ = dynamic
    prompt = tensor([[5, 6, 7]])

    def sampled(seed, **options):
        return built.generate(prompt, 8, generator=torch.Generator().manual_seed(seed), **options)

    hot = sampled(0, temperature=5.0)
    assert torch.equal(hot, sampled(0, temperature=5.0))
    assert not torch.equal(hot, built.generate(prompt, 8))
    assert torch.equal(hot[:, :3], prompt)


def test_top_k_limits_the_choice():
    from coopt.runtime.generate import sample

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    allowed = torch.topk(logits, 3, dim=-1).indices
    generator = torch.Generator().manual_seed(1)
    draws = torch.cat([sample(logits, 2.0, 3, generator) for _ in range(200)], dim=1)
    assert all(set(row.tolist()) <= set(ok.tolist()) for row, ok in zip(draws, allowed))
    assert torch.equal(sample(logits, 1.0, 1, generator), logits.argmax(-1, keepdim=True))
    assert torch.equal(sample(logits, 0.0, None, None), logits.argmax(-1, keepdim=True))


# -- call-time errors: one clear message each, and the cache stays as it was ----------------------


@pytest.mark.parametrize(
    "tokens, positions, error, message",
    [
        ([[1]], [128], ValueError, r"input_pos: holds 128, outside \[0, 128\): it indexes dim 2 \(size 128\) of the state "
                                   r"buffer 'layers.0.attention.k_cache' \(a position outside the KV cache\)"),
        ([[1]], [-1], ValueError, r"input_pos: holds -1, outside \[0, 128\)"),
        ([[1], [2]], [3], ValueError, r"tokens: dim 0 \(the batch\) has size 2, but this build takes exactly 1"),
        ([[256]], [3], ValueError, r"tokens: holds 256, outside \[0, 256\): it indexes dim 0 \(size 256\) of the weight 'embed.weight'"),
    ],
    ids=["position-at-max-seq", "negative-position", "batch-too-large", "token-outside-vocab"],
)
def test_bad_calls_are_refused_before_any_write(static, tokens, positions, error, message):
    built, _ = static
    before = caches(built)
    with pytest.raises(error, match=message):
        built(tensor(tokens), tensor(positions))
    with pytest.raises(error, match=message):
        built.check_call(tensor(tokens), tensor(positions))
    assert_caches_unchanged(built, before)


def test_wrong_dtype_is_refused(static):
    built, _ = static
    before = caches(built)
    with pytest.raises(TypeError, match=r"tokens: expected dtype torch.int64, got torch.int32"):
        built(tensor([[1]], dtype=torch.int32), tensor([3]))
    with pytest.raises(TypeError, match=r"input_pos: expected dtype torch.int64, got torch.float32"):
        built(tensor([[1]]), tensor([3.0]))
    with pytest.raises(TypeError, match=r"tokens: expected dtype torch.int64, got torch.int32"):
        built.generate(tensor([[1, 2]], dtype=torch.int32), 4)
    assert_caches_unchanged(built, before)


def test_dynamic_batch_beyond_the_cache_is_refused(dynamic):
    built, _ = dynamic
    before = caches(built)
    with pytest.raises(ValueError, match=r"tokens: dim 0 \(the batch\) has size 5, more than 4: it slices dim 0 "
                                         r"\(size 4\) of the state buffer 'layers.0.attention.k_cache'"):
        built(torch.zeros(5, 1, dtype=torch.int64, device=DEVICE), tensor([3]))
    with pytest.raises(ValueError, match=r"input_pos: dim 0 has size 2, but tokens dim 1 has size 3"):
        built(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE), tensor([3, 4]))
    with pytest.raises(ValueError, match=r"input_pos: holds 64, outside \[0, 64\)"):
        built(torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), tensor([63, 64]))
    with pytest.raises(ValueError, match=r"tokens: batch 5 is larger than the model was built for \(4\)"):
        built.generate(torch.zeros(5, 2, dtype=torch.int64, device=DEVICE), 4)
    assert_caches_unchanged(built, before)


@pytest.mark.parametrize(
    "prompt_length, new_tokens, message",
    [
        (4, 125, r"prompt length 4 \+ max_new_tokens 125 = 129 positions do not fit the KV cache of 128 positions"),
        (129, 0, r"prompt length 129 \+ max_new_tokens 0 = 129 positions do not fit the KV cache of 128 positions"),
    ],
)
def test_generate_refuses_requests_beyond_the_cache_up_front(static, prompt_length, new_tokens, message):
    built, _ = static
    before = caches(built)
    with pytest.raises(ValueError, match=message):
        built.generate(torch.ones(1, prompt_length, dtype=torch.int64, device=DEVICE), new_tokens)
    with pytest.raises(ValueError, match=r"tokens: holds 300, outside the vocabulary \[0, 256\)"):
        built.generate(tensor([[1, 2, 300]]), 4)  # checked before the first prompt token is written
    with pytest.raises(ValueError, match=r"tokens: batch 2 is larger than the model was built for \(1\)"):
        built.generate(torch.ones(2, 3, dtype=torch.int64, device=DEVICE), 4)
    assert_caches_unchanged(built, before)


def test_generate_needs_a_built_decoder():
    with pytest.raises(TypeError, match="not a built decoder"):
        coopt.generate(torch.nn.Linear(2, 2), torch.ones(1, 2, dtype=torch.int64), 3)


def test_graphed_step_checks_the_built_model_values(static):
    """A replay runs no Python, so GraphedStep checks with check_call first; without CUDA it
    calls the module, and checks the same way."""
    from coopt.runtime.cuda_graph import GraphedStep

    built, _ = static
    step = GraphedStep(built, (tensor([[1]]), tensor([0])))
    assert step.enabled == (DEVICE == "cuda") and step.check_call == built.check_call
    before = caches(built)
    with pytest.raises(ValueError, match=r"input_pos: holds 128, outside \[0, 128\)"):
        step(tensor([[1]]), tensor([128]))
    assert_caches_unchanged(built, before)


@pytest.mark.gpu
def test_decode_steps_replayed_as_cuda_graphs_match_plain_calls_and_eager(dynamic, llama):
    built, eager = dynamic
    prompt = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    graphed = built.generate(prompt, NEW_TOKENS)  # 3 sequences run as a bucket of 4
    assert torch.equal(graphed, built.generate(prompt, NEW_TOKENS, **PLAIN))
    assert torch.equal(graphed, llama.generate_reference(eager.model, prompt, NEW_TOKENS))
    assert torch.equal(built.generate(prompt, NEW_TOKENS), graphed)  # the cached graphs, replayed again
