"""KV-cache capacity (issue 4): how many concurrent sequences of mixed lengths fit in a fixed KV
memory budget — a static per-sequence allocation at the maximum length, paged bf16 pages, paged
fp8 pages — for Llama-3-8B's KV shape; with `--throughput`, the decode throughput at that capacity.

    python bench/capacity.py                                   # 32 layers, 64 GiB of KV, pages of 16
    python bench/capacity.py --budget-gib 40 --page-size 64 --layers 8
    python bench/capacity.py --throughput --out capacity.json  # + decode tokens/s on the GPU
    python bench/capacity.py --throughput --preset tiny --decode-budget-mib 0.125 \\
        --decode-lengths 8:64 --step-batch 4 --steps 2 --dtype float32 --reference-program  # CPU smoke
    python bench/capacity.py --throughput --step-batch 32       # session 7's run: 32 rows a call

Capacity is the allocator's arithmetic, not a timing: the real `coopt.runtime.paged.PagedKVCache`
(on torch's meta device: nothing is allocated) takes sequences with lengths drawn log-uniform
in [min, max] (seeded) until its pool runs out (`PoolExhausted`); the static allocation holds
budget // (max length x bytes per token) sequences whatever their lengths.

Throughput (`--throughput`, the real runtime): examples/llama/model.py (`--preset`, `--decode-layers`,
random weights, `--dtype`) built three times with one KV budget (`--decode-budget-mib`) and
cache length (the top of `--decode-lengths`):
- `paged`, `paged-fp8` (and on request `paged-fp8-recent`: `--kv-cache fp8-recent`, its rings of
  `--ring-slots` slots, 256 by default, taken out of the budget first): the ragged decode step (COOPT_LLAMA_RAGGED=1) at batch `--step-batch` (by
  default the sequences the variant's pool holds, rounded up to 8: one call a step, so a pool that
  holds more sequences streams the weights once for all of them; session 7 measured 32-row
  steps, 3 and 7 calls a step, slower than the static batch), with
  `paged-kv{page-size=P,num-pages=budget // bytes per page}` (and fp8-kv-cache, per-head scales,
  for `paged-fp8`), served by `coopt.runtime.serve.PagedDecoder`: sequences with the drawn lengths
  are placed in its pool until it is exhausted (capacity), the newest released until every
  remaining one can take the measured steps, then `PagedDecoder.step()` is timed: one token for
  every live sequence, `--step-batch` rows per call (the last call padded), each call a replay of
  the step captured as a CUDA graph (`PagedDecoder(cuda_graph=True)`, as bench/decode.py times
  decode) unless `--no-cuda-graph` (plain calls). Sequences are placed without their prefill (the
  pages a prompt of that length takes, holding whatever the pool held): a step's cost does not
  depend on the values, and a real prefill through the runtime pads each prompt to the build's batch.
- `static`: the plain decode step (one shared position) at the batch whose caches fill the budget at
  the maximum length, at the mean length of the sequences it holds (its attention reads as many
  keys as theirs: generous to static), greedy tokens to the host like the runtime: timed as plain
  calls and, on the GPU, replayed as a CUDA graph (`GraphedStep`); its row's step_ms / tokens_per_s
  are the replay with `--cuda-graph`, the plain calls without, and the other mode is kept beside.
`--cuda-graph` is the default on the GPU, `--no-cuda-graph` on the CPU (where graphs do not exist:
asking for them there is an error); the JSON records it in the settings and in every row.
Each build's weights.pt is deleted once loaded unless `--keep-weights` (a paged pool is the whole budget).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from coopt.runtime.paged import PagedKVCache, PoolExhausted

ROOT = Path(__file__).resolve().parents[1]
KV_HEADS, HEAD_DIM = 8, 128  # Llama-3-8B
DECODE_VARIANTS = ("paged", "static", "paged-fp8", "paged-fp8-recent")  # in this order: the comparison first
DEFAULT_VARIANTS = DECODE_VARIANTS[:3]  # paged-fp8-recent on request (--variants)
RECENT = 4  # fp8-recent's window: newest keys kept exact, in a ring slot a sequence


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--budget-gib", type=float, default=64.0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    decode = parser.add_argument_group("decode throughput at capacity (--throughput)")
    decode.add_argument("--throughput", action="store_true", help="build and time the decode step (GPU, or tiny on CPU)")
    decode.add_argument("--preset", default="llama-3-8b", help="examples/llama/model.py preset")
    decode.add_argument("--decode-layers", type=int, default=None, help="default 8 for llama-3-8b, else the preset's")
    decode.add_argument("--decode-budget-mib", type=float, default=4096, help="KV bytes of every variant, MiB")
    decode.add_argument("--decode-lengths", default="128:4096",
                        help="MIN:MAX sequence lengths (log-uniform); MAX is the caches' length")
    decode.add_argument("--step-batch", default="capacity",
                        help="rows per call of the paged step (its build's static caches: batch x cache positions); "
                             "'capacity' (default): each paged variant's step takes every sequence its pool holds "
                             "(rounded up to 8 rows), in as few calls as --max-step-rows allows")
    decode.add_argument("--max-step-rows", type=int, default=128,
                        help="with --step-batch capacity, the most rows of one call: the build checks its step "
                             "against a float copy of the original model, whose static caches are rows x cache "
                             "positions (session 8: 216 rows ran an H200 out of memory)")
    decode.add_argument("--steps", type=int, default=8, help="timed steps (after one untimed)")
    decode.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    decode.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"of {', '.join(DECODE_VARIANTS)} (default: the first three)")
    decode.add_argument("--ring-slots", type=int, default=256,
                        help="paged-fp8-recent: ring slots (paged-kv max-sequences), the most live sequences; their "
                             "rings come out of the KV budget")
    decode.add_argument("--top-k", type=int, default=2)
    decode.add_argument("--reference-program", action="store_true",
                        help="build without kernel regions (seconds on a CPU; smoke tests, not reported numbers)")
    decode.add_argument("--build-dir", type=Path, default=None, help="builds in DIR/<variant> (default: a temp dir)")
    decode.add_argument("--keep-weights", action="store_true", help="keep each build's weights.pt")
    decode.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="time decode steps replayed as CUDA graphs (default: on the GPU, yes)")
    args = parser.parse_args(argv)
    if args.cuda_graph is None:  # decode is timed replayed elsewhere (bench/decode.py): the same here
        args.cuda_graph = torch.cuda.is_available()
    elif args.cuda_graph and args.throughput and not torch.cuda.is_available():
        parser.error("--cuda-graph: CUDA graphs need a CUDA device (none here)")
    low, high = (int(v) for v in args.decode_lengths.split(":"))
    args.decode_min, args.decode_max = low, high
    args.variants = [v for v in args.variants.split(",") if v]
    if set(args.variants) - set(DECODE_VARIANTS):
        parser.error(f"--variants: choices are {', '.join(DECODE_VARIANTS)}")
    if args.step_batch != "capacity":
        if not args.step_batch.isdigit() or int(args.step_batch) < 2:
            parser.error("--step-batch: 'capacity' or a number of rows >= 2 (a ragged decode step has at least 2)")
        args.step_batch = int(args.step_batch)
    if args.decode_layers is None and args.preset == "llama-3-8b":
        args.decode_layers = 8
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def draw_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(count)]


# ── capacity: the allocator's arithmetic ──────────────────────────────────────────────────────────


def paged_capacity(args, dtype: torch.dtype, lengths: list[int]) -> dict:
    """Sequences of `lengths` added in order until the pool of `budget` bytes runs out."""
    probe = PagedKVCache(args.layers, 1, KV_HEADS, args.page_size, HEAD_DIM, dtype=dtype, device="meta",
                         **_scales(args, dtype))
    pages = int(args.budget_gib * 2**30) // probe.bytes_per_page()
    cache = PagedKVCache(args.layers, pages, KV_HEADS, args.page_size, HEAD_DIM, dtype=dtype, device="meta",
                         **_scales(args, dtype))
    held = 0
    for length in lengths:
        try:
            cache.add_sequence(length)
        except PoolExhausted:
            break
        held += length
    return {"sequences": len(cache.live_sequences()), "tokens": held, "pages": pages,
            "bytes_per_page": probe.bytes_per_page(), "pages_in_use": cache.pages_in_use(),
            "utilisation": held / (cache.pages_in_use() * args.page_size)}


def _scales(args, dtype):
    if dtype != torch.float8_e4m3fn:
        return {}
    ones = torch.ones(KV_HEADS)  # checked (positive) on the host, then moved with the pages
    return {"k_scale": ones, "v_scale": ones}


def capacity_rows(args) -> dict:
    lengths = draw_lengths(1_000_000, args.min_length, args.max_length, args.seed)
    budget = int(args.budget_gib * 2**30)
    per_token_bf16 = args.layers * 2 * KV_HEADS * HEAD_DIM * 2
    static = budget // (args.max_length * per_token_bf16)
    rows = {"static bf16 (max length each)": {"sequences": static, "tokens": sum(lengths[:static]),
                                               "utilisation": sum(lengths[:static]) / max(1, static * args.max_length)}}
    rows["paged bf16"] = paged_capacity(args, torch.bfloat16, lengths)
    rows["paged fp8 (per-head scales)"] = paged_capacity(args, torch.float8_e4m3fn, lengths)
    return rows


def capacity_table(args, rows: dict) -> str:
    static = rows["static bf16 (max length each)"]["sequences"]
    lines = [f"KV budget {args.budget_gib:g} GiB, {args.layers} layers x {KV_HEADS} kv heads x D {HEAD_DIM}, "
             f"pages of {args.page_size}, lengths log-uniform in [{args.min_length}, {args.max_length}] (seed {args.seed})",
             "| allocation | concurrent sequences | tokens held | slots used by tokens | vs static |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['sequences']} | {row['tokens']:,} | {row['utilisation']:.1%} | "
                     f"{row['sequences'] / max(1, static):.1f}x |")
    return "\n".join(lines)


# ── throughput: PagedDecoder.step() at capacity, and the static batch ─────────────────────────────


def placed_decoder(built, cuda_graph: bool = False):
    """A PagedDecoder that can place a sequence without its prefill (`place(length)`): the pages
    a prompt of that length takes, its first token 0, emitted by the next step like a prefilled one.
    `cuda_graph` is PagedDecoder's: the decode step captured now, replayed by every step."""
    from coopt.runtime.serve import PagedDecoder

    class PlacedDecoder(PagedDecoder):
        def place(self, length: int) -> int:
            seq_id = self._new_sequence(length)  # all or nothing: PoolExhausted changes nothing
            self._pending[seq_id] = 0  # what add() records after the prefill: the token the next step emits
            return seq_id

    return PlacedDecoder(built, cuda_graph=cuda_graph)


def fill(decoder, lengths: list[int], steps: int) -> dict:
    """Place sequences of `lengths` until the pool is exhausted (the capacity), then release the
    newest until every live one can take `steps` more positions (PagedDecoder.step is all or
    nothing: a pool without the pages for a step changes nothing and raises)."""
    page = decoder.contract["page_size"]
    held = []
    for length in lengths:
        try:
            held.append((decoder.place(length), length))
        except PoolExhausted:
            break
    capacity = {"capacity_sequences": len(held), "capacity_tokens": sum(n for _, n in held),
                "capacity_pages": decoder.pages_in_use(), "pool_pages": decoder.contract["num_pages"]}

    def growth(n):
        return -(-(n + steps) // page) - -(-n // page)

    while held and sum(growth(n) for _, n in held) > decoder.pages.free_pages():
        decoder.release(held.pop()[0])
    return {**capacity, "sequences": len(held), "tokens": sum(n for _, n in held)}


def measure_paged(built, lengths: list[int], args) -> dict:
    decoder = placed_decoder(built, cuda_graph=args.cuda_graph)
    row = fill(decoder, lengths, steps=2 + args.steps)
    row["cuda_graph"] = decoder.graph is not None
    row["bytes_per_page"] = decoder.bytes_per_page()
    row["bytes_held"] = decoder.bytes_held()
    decoder.step()  # the placed sequences' pending tokens: no model call
    seconds = []
    for i in range(1 + args.steps):  # the first step is untimed: kernels compile (or a graph's first replay)
        _synchronize()
        start = time.perf_counter()
        emitted = decoder.step()
        _synchronize()
        if i:
            seconds.append(time.perf_counter() - start)
        if len(emitted) != row["sequences"]:
            raise AssertionError(f"step emitted {len(emitted)} tokens for {row['sequences']} live sequences")
    calls = -(-row["sequences"] // decoder.contract["batch"])
    step_s = statistics.median(seconds)
    row.update(step_batch=decoder.contract["batch"], calls_per_step=calls, step_seconds=seconds, step_ms=step_s * 1e3,
               ms_per_call=step_s * 1e3 / calls, tokens_per_s=row["sequences"] / step_s)
    return row


def measure_static(built, batch: int, position: int, args, device) -> dict:
    """The shared-position step at `position` for `batch` rows: plain calls (greedy tokens to the
    host, as PagedDecoder does), and on the GPU replayed as a CUDA graph. step_ms / tokens_per_s
    are the replay's with --cuda-graph, else the plain calls'; both are kept (plain_*, graph_*)."""
    tokens = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    positions = torch.tensor([position], device=device)

    def timed(step) -> list[float]:
        seconds = []
        for i in range(1 + args.steps):
            _synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                step(tokens, positions)[:, -1].argmax(-1).tolist()
            if i:
                seconds.append(time.perf_counter() - start)
        return seconds

    plain = timed(built)
    row = {"sequences": batch, "position": position, "step_batch": batch, "calls_per_step": 1,
           "plain_step_ms": statistics.median(plain) * 1e3, "plain_tokens_per_s": batch / statistics.median(plain)}
    graphed = None
    if device.type == "cuda":
        from coopt.runtime.cuda_graph import GraphedStep

        graphed = timed(GraphedStep(built, (tokens, positions), check=False))
        row.update(graph_step_ms=statistics.median(graphed) * 1e3, graph_tokens_per_s=batch / statistics.median(graphed))
    seconds = graphed if args.cuda_graph and graphed is not None else plain
    step_s = statistics.median(seconds)
    row.update(cuda_graph=seconds is graphed, step_seconds=seconds, step_ms=step_s * 1e3, ms_per_call=step_s * 1e3,
               tokens_per_s=batch / step_s)
    return row


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_pipeline(args, num_pages: int, ring_slots: int | None = None) -> str:
    """The pipeline with paged-kv{page-size=P,num-pages=N[,max-sequences=R]} right after
    raise-patterns (fp8-kv-cache, added by Pipeline(kv_cache="fp8"), then goes between them,
    where --kv-cache fp8 puts it)."""
    import re

    from coopt.accuracy.builds import REFERENCE_PIPELINE
    from coopt.passes.registry import DEFAULT_PIPELINE

    base = REFERENCE_PIPELINE if args.reference_program else DEFAULT_PIPELINE
    slots = f",max-sequences={ring_slots}" if ring_slots else ""
    paged = f"paged-kv{{page-size={args.page_size},num-pages={num_pages}{slots}}}"
    return re.sub(r"(^|,)raise-patterns(\{[^}]*\})?", lambda m: f"{m.group(0)},{paged}", base, count=1)


def load_decode_model(args, device):
    """examples/llama/model.py with caches [step batch, Hkv, cache, D] and a ragged decode step
    as its example (the model file's module too, for `ragged_positions`)."""
    from coopt.frontend.model_file import import_model_file, load_model_file

    cache = args.decode_max
    first_batch = args.step_batch if isinstance(args.step_batch, int) else 2  # each build sets its own (build_variant)
    os.environ.update({"COOPT_LLAMA_PRESET": args.preset, "COOPT_LLAMA_BATCH": str(first_batch),
                       "COOPT_LLAMA_MAX_SEQ": str(cache), "COOPT_LLAMA_POS": str(cache // 2), "COOPT_LLAMA_RAGGED": "1",
                       "COOPT_LLAMA_PREFILL": "0", "COOPT_EXAMPLE_DTYPE": args.dtype,
                       **({"COOPT_LLAMA_LAYERS": str(args.decode_layers)} if args.decode_layers else {})})
    loaded = load_model_file(ROOT / "examples" / "llama" / "model.py")
    return loaded, loaded.model.to(device), import_model_file(ROOT / "examples" / "llama" / "model.py")


def decode_lengths(args) -> list[int]:
    """The sequences' lengths, in the order they are placed: log-uniform, each able to take the
    measured steps within the cache."""
    return draw_lengths(100_000, args.decode_min, args.decode_max - args.steps - 4, args.seed)


def decode_settings(args, model) -> dict:
    """KV bytes per token of each variant, the pools' pages, the paged steps' rows and the static
    batch in one budget."""
    dtype, margs = getattr(torch, args.dtype), model.args
    recent = "paged-fp8-recent" in args.variants  # (on request only: the settings of the default run unchanged)
    token_bytes = {name: margs.n_layers * 2 * margs.n_kv_heads * margs.head_dim * size
                   for name, size in (("paged", dtype.itemsize), ("static", dtype.itemsize), ("paged-fp8", 1),
                                      ("paged-fp8-recent", 1)) if recent or name != "paged-fp8-recent"}
    budget = int(args.decode_budget_mib * 2**20)
    longest = args.decode_max - args.steps - 4  # every sequence can take the measured steps within the cache
    # fp8-recent's rings (fp32 keys, values in the model's dtype: RECENT rows a ring slot) come
    # out of the same budget, the pages get the rest
    ring_bytes = args.ring_slots * margs.n_layers * margs.n_kv_heads * RECENT * margs.head_dim * (4 + dtype.itemsize)
    pool_pages = {name: max(0, budget - (ring_bytes if name == "paged-fp8-recent" else 0)) // (token_bytes[name] * args.page_size)
                  for name in ("paged", "paged-fp8", "paged-fp8-recent") if name in token_bytes}
    if args.step_batch == "capacity":  # every held sequence in one call: the weights stream once a step
        lengths = decode_lengths(args)
        step_batch = {name: planned_step_batch(pages, args.page_size, lengths, 2 + args.steps, args.max_step_rows)
                      for name, pages in pool_pages.items()}
    else:
        step_batch = dict.fromkeys(pool_pages, args.step_batch)
    return {"preset": args.preset, "layers": margs.n_layers, "dtype": args.dtype, "budget_bytes": budget,
            "cache": args.decode_max, "lengths": [args.decode_min, longest], "page_size": args.page_size,
            "step_batch": step_batch, "steps": args.steps, "top_k": args.top_k, "cuda_graph": args.cuda_graph,
            "pipeline": "reference program" if args.reference_program else "default", "kv_bytes_per_token": token_bytes,
            "pool_pages": pool_pages, **({"ring_bytes": ring_bytes} if recent else {}),
            "static_batch": budget // (args.decode_max * token_bytes["static"])}


class _PlannedPool:
    """fill()'s view of a PagedDecoder over a bare page allocator: how many sequences a pool of
    `num_pages` will hold, known before anything is built."""

    def __init__(self, num_pages: int, page_size: int):
        from coopt.runtime.pages import PageAllocator

        self.pages = PageAllocator(num_pages, page_size, reserved=1)  # as PagedDecoder's: one scratch page
        self.contract = {"page_size": page_size, "num_pages": num_pages}
        self.place, self.release, self.pages_in_use = self.pages.add_sequence, self.pages.release, self.pages.pages_in_use


def planned_step_batch(num_pages: int, page_size: int, lengths: list[int], steps: int, max_rows: int) -> int:
    """Rows for a paged step that takes every sequence the pool holds (fill()'s count) in as few
    calls of at most `max_rows` as it can, shared evenly, rounded up to 8 (padding rows read the
    scratch page: a few keys each)."""
    held = fill(_PlannedPool(num_pages, page_size), lengths, steps)["sequences"]
    calls = max(1, -(-held // max_rows))
    return max(8, -(-(-(-held // calls)) // 8) * 8)


def build_variant(name: str, model, loaded, llama, settings: dict, args, out: Path, device):
    """The build of one variant over `model` (its caches set to the variant's batch), loaded."""
    import coopt
    from coopt.accuracy.builds import REFERENCE_PIPELINE
    from coopt.passes.registry import DEFAULT_PIPELINE

    paged, cache = name != "static", settings["cache"]
    batch = settings["step_batch"][name] if paged else settings["static_batch"]
    if model.max_batch_size != batch:  # this build's static caches: batch x cache positions
        model.setup_caches(batch, cache)
    tokens = torch.randint(0, model.args.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(1))
    top = cache // 2
    if paged:  # the build checks its example against the original within the pool: B x pages of the top position
        top = min(top, (settings["pool_pages"][name] - 1) // batch * args.page_size - 1)
    positions = llama.ragged_positions(top, batch) if paged else torch.tensor([top])
    if paged:
        passes = decode_pipeline(args, settings["pool_pages"][name], args.ring_slots if name == "paged-fp8-recent" else None)
    else:
        passes = REFERENCE_PIPELINE if args.reference_program else DEFAULT_PIPELINE
    kv_cache = {"paged-fp8": "fp8", "paged-fp8-recent": "fp8-recent"}.get(name, "none")
    calibration = [tuple(x.to(device) for x in call) for call in loaded.calibration_inputs] if kv_cache != "none" else None
    start = time.monotonic()
    coopt.Pipeline(passes, top_k=args.top_k, kv_cache=kv_cache).build(
        model, (tokens.to(device), positions.to(device)), out, force=True, calibration_inputs=calibration,
        progress=lambda step, detail="": log(f"    {time.monotonic() - start:7.1f}s [{step}] {detail}"))
    built = coopt.load(out)
    if not args.keep_weights:  # loaded: a paged build's weights.pt holds the whole pool
        (out / "weights.pt").unlink(missing_ok=True)
    return built, time.monotonic() - start


def run_throughput(args, result: dict) -> dict:
    """Build and time each variant into result["throughput"] (args.out rewritten after each)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.monotonic()
    loaded, model, llama = load_decode_model(args, device)
    settings = decode_settings(args, model)
    log(f"decode throughput: {args.preset}, {settings['layers']} layers, {args.dtype}, loaded in "
        f"{time.monotonic() - start:.0f}s; pools of {settings['pool_pages']} pages, paged steps of "
        f"{settings['step_batch']} rows, static batch {settings['static_batch']}, "
        f"{'CUDA graphs' if args.cuda_graph else 'plain calls'}")
    throughput = result["throughput"] = {"settings": settings, "rows": {}}
    lengths = decode_lengths(args)
    build_root = args.build_dir or Path(tempfile.mkdtemp(prefix="coopt-capacity-"))
    for name in [v for v in DECODE_VARIANTS if v in args.variants]:
        if name == "static" and settings["static_batch"] < 1:
            throughput["rows"][name] = {"status": f"the budget holds no sequence of {settings['cache']} positions"}
            continue
        log(f"  building {name}")
        try:
            built, build_s = build_variant(name, model, loaded, llama, settings, args, build_root / name, device)
            if name == "static":  # its sequences' mean length: its attention reads as many keys as theirs
                position = round(statistics.mean(lengths[:settings["static_batch"]]))
                row = measure_static(built, settings["static_batch"], position, args, device)
            else:
                row = measure_paged(built, lengths, args)
            row.update(status="ok", build_s=build_s, kv_bytes_per_token=settings["kv_bytes_per_token"][name])
            log(f"  {name}: {row['sequences']} sequences, {row['step_ms']:.2f} ms per step ({row['calls_per_step']} "
                f"{'replays' if row['cuda_graph'] else 'calls'}), "
                f"{row['tokens_per_s']:,.0f} tokens/s")
        except Exception as error:  # noqa: BLE001 - a failed variant is a result; the others still run
            row = {"status": f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
            log(f"  {name}: {row['status'][:300]}")
        finally:
            built = None  # the next build needs the memory
            if device.type == "cuda":
                torch.cuda.empty_cache()
        throughput["rows"][name] = row
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))
    if args.build_dir is None:
        shutil.rmtree(build_root, ignore_errors=True)
    return throughput


def throughput_table(result: dict) -> str:
    s = result["settings"]
    other = "plain" if s["cuda_graph"] else "graph"  # the static step's other timing, when it has one
    lines = [f"Decode at capacity: {s['preset']} ({s['layers']} layers, {s['dtype']}), KV budget "
             f"{s['budget_bytes'] / 2**20:g} MiB, lengths log-uniform in {s['lengths']}, cache {s['cache']}, "
             f"pages of {s['page_size']}; median of {s['steps']} steps, "
             f"{'replayed as CUDA graphs' if s['cuda_graph'] else 'plain calls'}",
             "| variant | sequences (capacity) | rows per call | calls per step | calls | ms per step | ms per call | "
             f"tokens/s | {'plain-call' if other == 'plain' else 'graph-replayed'} tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in result["rows"].items():
        if row.get("status") != "ok":
            lines.append(f"| {name} | {row.get('status')} | | | | | | | |")
            continue
        capacity = f"{row['sequences']} ({row.get('capacity_sequences', row['sequences'])})"
        calls = "graph replay" if row["cuda_graph"] else "plain"
        alternative = f"{row[f'{other}_tokens_per_s']:,.0f}" if f"{other}_tokens_per_s" in row else "—"
        lines.append(f"| {name} | {capacity} | {row['step_batch']} | {row['calls_per_step']} | {calls} | "
                     f"{row['step_ms']:.2f} | {row['ms_per_call']:.2f} | {row['tokens_per_s']:,.0f} | {alternative} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows = capacity_rows(args)
    print(capacity_table(args, rows), flush=True)
    result = {"capacity": rows}
    if args.throughput:
        from long_prefill import environment

        from coopt.runtime.kernel_loader import use_interpreter_without_gpu

        use_interpreter_without_gpu()  # before anything imports triton.language (environment() does)
        result["environment"] = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        log(json.dumps(result["environment"]))
        run_throughput(args, result)
        print("\n" + throughput_table(result["throughput"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
