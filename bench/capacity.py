"""KV-cache capacity (issue 4): how many concurrent sequences of mixed lengths fit in a fixed KV
memory budget — a static per-sequence allocation at the maximum length, paged bf16 pages, paged
fp8 pages — for Llama-3-8B's KV shape.

    python bench/capacity.py                                   # 32 layers, 64 GiB of KV, pages of 16
    python bench/capacity.py --budget-gib 40 --page-size 64 --layers 8

Capacity is the allocator's arithmetic, not a timing: the real `coopt.runtime.paged.PagedKVCache`
(on torch's meta device: nothing is allocated) takes sequences with lengths drawn log-uniform
in [min, max] (seeded) until its pool runs out (`PoolExhausted`); the static allocation holds
budget // (max length x bytes per token) sequences whatever their lengths. Decode throughput at
that capacity needs the GPU and the paged-kv pass (not built yet): not measured here.
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from coopt.runtime.paged import PagedKVCache, PoolExhausted

KV_HEADS, HEAD_DIM = 8, 128  # Llama-3-8B


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--budget-gib", type=float, default=64.0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def draw_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(count)]


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
            "utilisation": held / (cache.pages_in_use() * args.page_size)}


def _scales(args, dtype):
    if dtype != torch.float8_e4m3fn:
        return {}
    ones = torch.ones(KV_HEADS)  # checked (positive) on the host, then moved with the pages
    return {"k_scale": ones, "v_scale": ones}


def main():
    args = parse_args()
    lengths = draw_lengths(1_000_000, args.min_length, args.max_length, args.seed)
    budget = int(args.budget_gib * 2**30)
    per_token_bf16 = args.layers * 2 * KV_HEADS * HEAD_DIM * 2
    static = budget // (args.max_length * per_token_bf16)
    rows = {"static bf16 (max length each)": {"sequences": static, "tokens": sum(lengths[:static]),
                                               "utilisation": sum(lengths[:static]) / max(1, static * args.max_length)}}
    rows["paged bf16"] = paged_capacity(args, torch.bfloat16, lengths)
    rows["paged fp8 (per-head scales)"] = paged_capacity(args, torch.float8_e4m3fn, lengths)
    print(f"KV budget {args.budget_gib:g} GiB, {args.layers} layers x {KV_HEADS} kv heads x D {HEAD_DIM}, "
          f"pages of {args.page_size}, lengths log-uniform in [{args.min_length}, {args.max_length}] (seed {args.seed})")
    print("| allocation | concurrent sequences | tokens held | slots used by tokens | vs static |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['sequences']} | {row['tokens']:,} | {row['utilisation']:.1%} | "
              f"{row['sequences'] / max(1, static):.1f}x |")


if __name__ == "__main__":
    main()
