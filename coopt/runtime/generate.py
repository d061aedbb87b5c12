"""Token generation with a built decoder: prefill the prompt, then decode one token per step.

    built = coopt.load("out/llama")
    tokens = coopt.generate(built, prompt, 32)                      # greedy, [B, T + 32]
    tokens = built.generate(prompt, 32, temperature=0.8, top_k=50,
                            generator=torch.Generator().manual_seed(0))

The model is a decoder step `forward(tokens [B, T] int64, positions [T] int64) -> [B, T, V]`
that writes its KV cache in place (gpt-fast style); a coopt build of one carries the contract
as `model.decoder` (cache length, the batch and length ranges one call accepts), derived from
its IR. Prefill: through the artifact's `prefill` entry point (`model.entry_points["prefill"]`,
see `entry_points()` in a model file) or the model itself when the build accepts T > 1 (exported
with a dynamic sequence dim), one call per chunk of the prompt — the build's prefill chunk
(DECODER["prefill_chunk"], set by `--prefill-chunk`) or the `prefill_chunk=` argument, capped
by the longest T a call accepts; each chunk attends to the cache the chunks before it wrote —
else the prompt is fed token by token through the decode step, unless `prefill` is given: a
callable with the same signature that writes the *same* cache (e.g. a model whose cache
buffers are the decode model's). Decode steps replay a
CUDA graph per batch bucket on the GPU (`cuda_graphs=False` calls the module); on the CPU they
call the module. Imports torch only.
"""

from __future__ import annotations

import math
import numbers

import torch

from coopt.runtime.cuda_graph import GraphedStep

# the model's own attribute holding {(rows, device, weights address): captured decode step}:
# graphs live as long as the model, and a moved model (new addresses) captures anew
GRAPHS_ATTR = "_coopt_decode_graphs"


def decoder_contract(model) -> dict:
    """`model.decoder`: {"tokens", "positions", "dtype", "max_seq", "batch": [lo, hi],
    "length": [lo, hi], "token_range": [lo, hi] or None[, "prefill_chunk": int]} (ranges of one
    call; hi exclusive for token ids only; "prefill_chunk" only in a chunked-prefill build)."""
    contract = getattr(model, "decoder", None)
    if not isinstance(contract, dict):
        raise TypeError(
            f"{type(model).__name__} is not a built decoder: generate() needs a coopt build of a step "
            "forward(tokens [B, T], positions [T]) that writes a KV cache (its `decoder` attribute)"
        )
    return contract


@torch.no_grad()
def generate(model, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             generator: torch.Generator | None = None, prefill=None, cuda_graphs: bool = True,
             prefill_chunk: int | None = None) -> torch.Tensor:
    """Continue each prompt row of `tokens` [B, T] by `max_new_tokens` tokens; returns
    [B, T + max_new_tokens] on the model's device.

    Greedy (argmax) when `temperature` is 0, else sampled from softmax(logits / temperature),
    restricted to the `top_k` most likely tokens when given, with torch.multinomial and
    `generator` (seed it for reproducible samples; on the GPU a CPU generator samples on the
    CPU). The KV cache is rewritten from position 0 on; with the causal cache mask of such
    models (`cache_position <= position`) nothing an earlier call wrote is attended to.
    Everything about the request (prompt + new tokens within the cache, the batch, the dtype,
    the prompt's token ids) is checked before the first model call, so a rejected request
    leaves the cache as it was.

    The prompt is prefilled in chunks of `prefill_chunk` tokens (default: the build's
    DECODER["prefill_chunk"], else the longest call it accepts), never more than one call of the
    prefill entry (or model) accepts; a `prefill` callable gets the whole prompt in one call.

    >>> coopt.generate(built, torch.tensor([[1, 5, 7]]), 4).shape  # doctest: +SKIP
    torch.Size([1, 7])
    """
    contract = decoder_contract(model)
    batch, prompt_length = _check_request(contract, tokens, max_new_tokens, temperature, top_k)
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
    device = _model_device(model, tokens)
    tokens = tokens.to(device)
    if max_new_tokens == 0:
        return tokens.clone()
    graphs = cuda_graphs and device.type == "cuda" and torch.cuda.is_available()
    rows = _call_batch(contract, batch, bucket=graphs)
    padded = _pad_rows(tokens, rows)
    step = _decode_step(model, rows, device, graphs)

    logits = _prefill(model, contract, prefill, step, padded, device, prefill_chunk)
    generated = [tokens]
    for i in range(max_new_tokens):
        next_token = sample(logits[:batch], temperature, top_k, generator)
        generated.append(next_token)
        if i + 1 < max_new_tokens:
            position = torch.tensor([prompt_length + i], device=device)
            logits = step(_pad_rows(next_token, rows), position)[:, -1]
    return torch.cat(generated, dim=1)


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """Next tokens [B, 1] from last-position logits [B, V]: argmax at temperature 0."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    where = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(where), 1, generator=generator).to(logits.device)


def check_sampling(temperature, top_k) -> None:
    """ValueError naming the argument unless `temperature` is a finite number >= 0 (0: greedy)
    and `top_k` None or an int >= 1 (bools are neither). generate() and PagedDecoder check with it."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


def _check_request(contract: dict, tokens, max_new_tokens, temperature, top_k) -> tuple[int, int]:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"tokens: expected a [batch, prompt length] tensor, got {_describe(tokens)}")
    if str(tokens.dtype).removeprefix("torch.") != contract["dtype"]:
        raise TypeError(f"tokens: expected dtype torch.{contract['dtype']}, got {tokens.dtype}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_sampling(temperature, top_k)
    batch, prompt_length = tokens.shape
    max_seq, (_, max_batch), (min_length, _) = contract["max_seq"], contract["batch"], contract["length"]
    if prompt_length < 1:
        raise ValueError("tokens: the prompt is empty (prompt length 0)")
    if prompt_length + max_new_tokens > max_seq:
        raise ValueError(
            f"prompt length {prompt_length} + max_new_tokens {max_new_tokens} = {prompt_length + max_new_tokens} "
            f"positions do not fit the KV cache of {max_seq} positions"
        )
    if batch > max_batch:
        raise ValueError(f"tokens: batch {batch} is larger than the model was built for ({max_batch})")
    if min_length > 1:
        raise ValueError(f"the model takes at least {min_length} tokens per call, so it cannot decode one at a time")
    if contract.get("token_range") is not None:  # every prompt token, before the first cache write
        low, high = contract["token_range"]
        smallest, largest = torch.stack(torch.aminmax(tokens)).tolist()
        bad = smallest if smallest < low else largest if largest >= high else None
        if bad is not None:
            raise ValueError(f"tokens: holds {bad}, outside the vocabulary [{low}, {high})")
    return batch, prompt_length


def _describe(value) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _model_device(model, tokens) -> torch.device:
    first = next(iter(model.buffers()), None) if isinstance(model, torch.nn.Module) else None
    return first.device if first is not None else tokens.device


def _call_batch(contract: dict, batch: int, bucket: bool) -> int:
    """Rows of each call: the build's static batch, else (graphs) the power-of-two bucket, else
    the batch itself; never below the build's minimum. Padding rows decode token 0, unread."""
    low, high = contract["batch"]
    if low == high:
        return high
    rows = 1 << (batch - 1).bit_length() if bucket else batch
    return max(low, min(rows, high))


def _pad_rows(tokens: torch.Tensor, rows: int) -> torch.Tensor:
    if tokens.shape[0] == rows:
        return tokens
    return torch.cat([tokens, tokens.new_zeros(rows - tokens.shape[0], tokens.shape[1])])


def _decode_step(model, rows: int, device: torch.device, graphs: bool):
    """The one-token step: model(tokens [rows, 1], positions [1]), replayed as a CUDA graph."""
    if not graphs:
        return model
    cache = next(iter(model.buffers()), None)
    key = (rows, str(device), cache.data_ptr() if cache is not None else 0)
    per_model = model.__dict__.setdefault(GRAPHS_ATTR, {})
    if key not in per_model:
        per_model[key] = _LazyGraph(model)
    return per_model[key]


class _LazyGraph:
    """Captures at the first call, with that call's inputs: warm-up and capture write the same
    cache entries the step itself writes, so nothing else in the cache changes. generate() has
    checked positions and produces tokens in the vocabulary, so replays skip the value check."""

    def __init__(self, model):
        self.model, self.graph = model, None

    def __call__(self, tokens, positions):
        if self.graph is None:
            self.graph = GraphedStep(self.model, (tokens, positions), check=False)
        return self.graph(tokens, positions)


def _prefill(model, contract: dict, prefill, step, padded: torch.Tensor, device, prefill_chunk: int | None = None) -> torch.Tensor:
    """Logits [rows, V] of the last prompt position, after writing every prompt position."""
    prompt_length = padded.shape[1]
    if prefill is not None:
        return prefill(padded, torch.arange(prompt_length, device=device))[:, -1]
    entry = getattr(model, "entry_points", {}).get("prefill")
    entry_contract = entry.decoder if isinstance(getattr(entry, "decoder", None), dict) else None
    # tokens per call: the requested chunk, else the build's, else the longest one call takes
    model_chunk = _chunk(contract, prefill_chunk)  # 1: a decode-only build
    entry_chunk = _chunk(entry_contract, prefill_chunk) if entry_contract is not None else 0
    entry_min = entry_contract["length"][0] if entry_contract is not None else 0
    start = 0
    while start < prompt_length:
        left = prompt_length - start
        if entry_contract is not None and entry_min <= min(left, entry_chunk):
            # the artifact's prefill entry point: same weights and cache, many tokens per call
            run, size = entry, min(left, entry_chunk)
        else:
            run, size = (model if model_chunk > 1 else step), min(left, model_chunk)
        piece = padded[:, start:start + size]
        logits = run(piece, torch.arange(start, start + size, device=device))[:, -1]
        start += size
    return logits


def _chunk(contract: dict, requested: int | None) -> int:
    """Tokens per prefill call of a decoder: min(requested or its prefill chunk or the longest
    call, the longest call)."""
    longest = contract["length"][1]
    return min(requested or contract.get("prefill_chunk") or longest, longest)
