"""Train examples/llama/model.py's Transformer, byte-level, on the stdlib corpus, and save it as a
Hugging Face LlamaForCausalLM directory (config.json + model.safetensors) that the model file's
own `load_hf_checkpoint` reads back.

    python -m coopt.accuracy.train --config small --steps 2000 --out runs/stdlib-small
    python -m coopt.accuracy.train --config tiny --steps 30 --out /tmp/acc-tiny     # CPU, seconds

    model, history = train("tiny", steps=50, batch=8, seq_len=64, device="cpu", seed=0)
    save_hf_checkpoint(model, "runs/tiny"); model = load_checkpoint("runs/tiny")
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from coopt.accuracy.corpus import Corpus, load_corpus
from coopt.accuracy.metrics import heldout_windows

MODEL_PATH = Path(__file__).resolve().parents[2] / "examples" / "llama" / "model.py"

# ModelArgs fields; vocab 256: one token per byte
CONFIGS: dict[str, dict] = {
    # 2.95 M parameters, GQA 8:2; a few thousand steps on one GPU (~0.7 s/step at batch 8 on 2 CPU cores)
    "small": dict(hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden_size=704, vocab_size=256,
                  max_position_embeddings=512),
    # CPU CI: trains in seconds
    "tiny": dict(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=176, vocab_size=256,
                 max_position_embeddings=256),
}


@functools.cache
def llama() -> ModuleType:
    """examples/llama/model.py, imported once: every import makes a new ModelArgs class, and
    load_hf_checkpoint compares ModelArgs instances, which only equal instances of the same class."""
    from coopt.frontend.model_file import import_model_file

    return import_model_file(MODEL_PATH)


def model_args(config: str | dict):
    """ModelArgs of a named config (CONFIGS) or of a dict of ModelArgs fields."""
    fields = CONFIGS[config] if isinstance(config, str) else config
    return llama().ModelArgs(**fields)


@dataclass
class History:
    """Losses (nats per byte) of a training run."""
    config: dict
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    heldout_loss: float | None = None
    seconds: float = 0.0
    parameters: int = 0
    settings: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def random_crops(data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] int64 windows at uniform random offsets: inputs [:, :-1], targets [:, 1:]."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator)
    return data[starts[:, None] + torch.arange(seq_len + 1)].long()


def next_byte_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy (nats) of predicting windows[:, 1:] from windows[:, :-1], cache-free."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, windows: int = 64, batch: int = 16) -> float:
    """Mean next-byte loss over `windows` evenly spaced windows of `data` (deterministic)."""
    device = model.output.weight.device
    chunks = heldout_windows(data, seq_len, windows).split(batch)
    losses = [next_byte_loss(model, chunk.to(device)).item() * len(chunk) for chunk in chunks]
    return sum(losses) / sum(len(chunk) for chunk in chunks)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to peak / 10."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def new_model(config: str | dict, seq_len: int, device: str | torch.device = "cpu", seed: int = 0):
    """A seeded fp32 Transformer with RoPE tables for `seq_len` positions (cache-free forward)."""
    args = model_args(config)
    model = llama().Transformer(args, dtype=torch.float32, seed=seed).to(device)
    model.setup_caches(max_batch_size=1, max_seq_length=min(seq_len, args.max_position_embeddings))
    return model


def train(config: str | dict = "tiny", steps: int = 200, batch: int = 16, seq_len: int = 128,
          device: str | torch.device = "cpu", seed: int = 0, log_every: int = 50, lr: float = 3e-3,
          weight_decay: float = 0.1, corpus: Corpus | None = None, heldout_windows_count: int = 64,
          log=print) -> tuple[torch.nn.Module, History]:
    """Train from seeded random weights on random crops of the corpus's train split; fp32 weights
    (bf16 autocast on CUDA). Returns the model (eval mode) and its History (loss every
    `log_every` steps, held-out loss at the end)."""
    device = torch.device(device)
    corpus = corpus if corpus is not None else load_corpus()
    torch.manual_seed(seed)
    model = new_model(config, seq_len, device, seed)
    if seq_len > model.max_seq_length:
        raise ValueError(f"seq_len {seq_len} exceeds max_position_embeddings {model.args.max_position_embeddings}")
    # no decay on norm weights (and biases): decaying them pulls the norms towards zero
    decay = [p for name, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for name, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    warmup = max(1, min(100, steps // 10))
    generator = torch.Generator().manual_seed(seed)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    history = History(config=CONFIGS[config] if isinstance(config, str) else dict(config),
                      parameters=sum(p.numel() for p in model.parameters()),
                      settings=dict(steps=steps, batch=batch, seq_len=seq_len, lr=lr, seed=seed, device=str(device)))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup)
        windows = random_crops(corpus.train, batch, seq_len, generator).to(device)
        with autocast:
            loss = next_byte_loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0 or step == steps - 1:
            history.steps.append(step)
            history.losses.append(loss.item())
            log(f"step {step:5d}  loss {loss.item():.4f}  lr {optimizer.param_groups[0]['lr']:.2e}  "
                f"{time.perf_counter() - start:.1f}s")
    model.eval()
    history.heldout_loss = evaluate(model, corpus.heldout, seq_len, heldout_windows_count)
    history.seconds = time.perf_counter() - start
    log(f"held-out loss {history.heldout_loss:.4f} nats/byte ({history.heldout_loss / math.log(2):.3f} bits/byte), "
        f"{history.seconds:.1f}s, {history.parameters / 1e6:.2f} M parameters")
    return model, history


# ── Hugging Face checkpoints: the exact inverse of the model file's load_hf_checkpoint ──────────

_OWN_NAMES = [  # our state-dict name -> Hugging Face's; own_name() of the result gives ours back
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.w([qkvo])\.(weight|bias)", "model.layers.{0}.self_attn.{1}_proj.{2}"),
    (r"layers\.(\d+)\.feed_forward\.w_(gate|up|down)\.weight", "model.layers.{0}.mlp.{1}_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]


def hf_name(name: str) -> str:
    """The Hugging Face name of one of our parameters (`layers.0.attention.wq.weight` ->
    `model.layers.0.self_attn.q_proj.weight`)."""
    for pattern, template in _OWN_NAMES:
        if match := re.fullmatch(pattern, name):
            return template.format(*match.groups())
    raise ValueError(f"no Hugging Face name for '{name}'")


def hf_config(args) -> dict:
    """config.json of a LlamaForCausalLM with these ModelArgs, the fields ModelArgs.from_hf_config reads."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "mlp_bias": False,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.ffn_hidden_size,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_position_embeddings,
        "attention_bias": args.attention_bias,
        "tie_word_embeddings": args.tie_word_embeddings,
        "torch_dtype": "float32",
    }
    if args.rope_scaling is not None:
        config["rope_scaling"] = dict(args.rope_scaling)
    if args.sliding_window is not None:
        config.update(sliding_window=args.sliding_window, use_sliding_window=True)
    return config


def save_hf_checkpoint(model, directory: str | Path, extra: dict | None = None) -> Path:
    """Write config.json + model.safetensors (HF names, the weights' dtype); `extra` goes to
    training.json (corpus, history) so a checkpoint says what it was trained on."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    own_name = llama().own_name
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and model.args.tie_word_embeddings:
            continue  # HF leaves the tied head out; load_hf_checkpoint copies the embedding
        hf = hf_name(name)
        assert own_name(hf) == name, (name, hf)  # the inverse of the loader's table, checked
        tensors[hf] = tensor.detach().to("cpu").contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config(model.args), indent=2) + "\n")
    if extra is not None:
        (directory / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    return directory


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu", seq_len: int | None = None):
    """A Transformer (fp32, eval) from a Hugging Face directory, RoPE tables for `seq_len`
    positions (default max_position_embeddings), via the model file's load_hf_checkpoint."""
    module = llama()
    args = module.ModelArgs.from_hf_config(json.loads((Path(directory) / "config.json").read_text()))
    model = module.Transformer(args, dtype=torch.float32, seed=None)
    module.load_hf_checkpoint(model, directory)
    model = model.to(device).eval()
    model.setup_caches(max_batch_size=1, max_seq_length=seq_len or args.max_position_embeddings)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train a byte-level Llama on the Python stdlib sources.")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=None, help="default: max_position_embeddings")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--max-bytes", type=int, default=None, help="use only the first ~N bytes of the corpus")
    parser.add_argument("--out", type=Path, default=None, help="save the checkpoint (HF format) here")
    options = parser.parse_args(argv)
    seq_len = options.seq_len or CONFIGS[options.config]["max_position_embeddings"]
    corpus = load_corpus(options.max_bytes)
    print(f"corpus: {corpus.describe()}")
    model, history = train(options.config, options.steps, options.batch, seq_len, options.device, options.seed,
                           options.log_every, lr=options.lr, corpus=corpus)
    if options.out is not None:
        save_hf_checkpoint(model, options.out, extra={"corpus": corpus.describe(), "history": asdict(history)})
        print(f"saved {options.out}")


if __name__ == "__main__":
    main()
