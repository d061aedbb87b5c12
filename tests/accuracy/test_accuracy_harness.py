"""The offline accuracy harness on CPU: stdlib corpus, tiny training, HF round trip, metrics."""

from __future__ import annotations

import json

import pytest
import torch

from coopt.accuracy import metrics, train
from coopt.accuracy.corpus import HELDOUT_EVERY, load_corpus, source_files, stdlib_root

SEQ_LEN = 64  # the training crops of conftest's `trained`


def test_corpus_is_deterministic_and_split_by_file(corpus):
    again = load_corpus(max_bytes=400_000)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.heldout, again.heldout)
    assert corpus.describe() == again.describe()
    assert corpus.train.numel() > 0 and corpus.heldout.numel() > 0
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    files = source_files(stdlib_root())
    assert corpus.heldout_files == [name for i, name in enumerate(files[:len(corpus.train_files) + len(corpus.heldout_files)])
                                    if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    assert not any(name.startswith("test/") or "site-packages" in name for name in files)
    described = corpus.describe()
    assert described["train_files"] == len(corpus.train_files) and described["python_version"]
    assert described["train_bytes"] + described["heldout_bytes"] >= 400_000


def test_training_lowers_the_loss(corpus, trained):
    model, history = trained
    fixed_batch = train.random_crops(corpus.train, 16, SEQ_LEN, torch.Generator().manual_seed(123))
    untrained = train.new_model("tiny", SEQ_LEN, seed=0)  # the weights training started from
    with torch.no_grad():
        before = train.next_byte_loss(untrained, fixed_batch).item()
        after = train.next_byte_loss(model, fixed_batch).item()
    assert after < 0.8 * before, (before, after)
    assert history.losses[-1] < 0.8 * history.losses[0]
    assert history.heldout_loss is not None and history.heldout_loss < 0.8 * before
    assert history.parameters == sum(p.numel() for p in model.parameters())


def test_hf_checkpoint_round_trip(trained, tmp_path):
    model, history = trained
    train.save_hf_checkpoint(model, tmp_path, extra={"history": history.steps})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    loaded = train.load_checkpoint(tmp_path, seq_len=SEQ_LEN)
    tokens = torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), loaded(tokens))
    # every parameter name maps to Hugging Face's and back through the model file's own table
    for name in model.state_dict():
        assert train.llama().own_name(train.hf_name(name)) == name


def test_identical_models_agree_exactly(corpus, trained):
    model, _ = trained
    logits_fn = metrics.model_logits_fn(model)
    report = metrics.compare(logits_fn, logits_fn, corpus.heldout, seq_len=SEQ_LEN, windows=8,
                             greedy_prompts=4, prompt_len=16, greedy_tokens=12)
    assert report.kl_mean <= 1e-6 and report.kl_max <= 1e-6
    assert report.top1_agreement == 1.0 and report.perplexity_change == 0.0
    assert report.greedy_agreement == 12 and report.windows == 8
    assert json.loads(report.to_json())["top1_agreement"] == 1.0


def test_perturbed_model_differs(corpus, trained):
    model, _ = trained
    noisy = train.new_model("tiny", SEQ_LEN, seed=0)
    noisy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05 * param.std())
    report = metrics.compare(metrics.model_logits_fn(model), metrics.model_logits_fn(noisy), corpus.heldout,
                             seq_len=SEQ_LEN, windows=8, greedy_prompts=4, prompt_len=16, greedy_tokens=12)
    assert report.kl_mean > 0
    assert report.top1_agreement < 1.0 or report.perplexity_change != 0.0


def test_leading_agreement_counts_the_prefix():
    a = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    b = torch.tensor([[1, 2, 9, 4], [5, 2, 3, 4]])
    assert metrics.leading_agreement(a, b).tolist() == [2, 0]


def test_wilson_interval_brackets_the_rate_and_narrows_with_more_trials():
    # 44 disagreements in 4096 predictions (session 9's smoothed-K build): 99 % lies inside
    low, high = metrics.wilson_interval(1 - 44 / 4096, 4096)
    assert low < 0.99 < high and high - low == pytest.approx(0.0063, abs=0.0005)
    wide, narrow = metrics.wilson_interval(0.9, 100), metrics.wilson_interval(0.9, 10000)
    assert wide[0] < narrow[0] < 0.9 < narrow[1] < wide[1]
    assert metrics.wilson_interval(1.0, 50)[1] == 1.0 and metrics.wilson_interval(0.0, 50)[0] == 0.0


def test_flips_report_how_close_the_reference_was_to_a_tie():
    """A candidate that swaps the reference's top two tokens everywhere: every position flips;
    the reference's margin is 0.05 nats after an even input token, 2 after an odd one, so the
    near-tie share is the share of even inputs."""
    data = torch.randint(0, 3, (4000,), generator=torch.Generator().manual_seed(3))  # tokens are the 3 logits

    def logits(swap):
        def fn(tokens):
            margin = torch.where(tokens % 2 == 0, 0.05, 2.0)
            top, second = torch.zeros_like(margin), -margin
            pair = (second, top) if swap else (top, second)
            return torch.stack([*pair, torch.full_like(margin, -10.0)], dim=-1)
        return fn

    report = metrics.compare(logits(False), logits(True), data, seq_len=32, windows=16, greedy_tokens=0)
    inputs = metrics.heldout_windows(data, 32, 16)[:, :-1]
    assert report.top1_agreement == 0.0
    assert report.flip_near_ties == pytest.approx((inputs % 2 == 0).double().mean().item(), abs=1e-12)
    assert report.flip_margin_median == pytest.approx(0.05 if report.flip_near_ties > 0.5 else 2.0, abs=1e-6)
    same = metrics.compare(logits(False), logits(False), data, seq_len=32, windows=16, greedy_tokens=0)
    assert same.top1_agreement == 1.0 and same.flip_near_ties == 0.0  # no flips, nothing to report
