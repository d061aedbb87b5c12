"""A paged build seen as the static-cache model it was built from (torch only).

paged-kv (coopt/passes/paged_kv.py) turns each KV cache [B_max, Hkv, S, D] (and each per-token
fp8 scale buffer [B_max, Hkv, S]) into a pool of pages;
the emitter stores each cache's contents in the identity layout (sequence b in pages b * J ..
b * J + J - 1), and the build's end-to-end check calls the paged program through `StaticView`
with that layout's page table (and, with exact-recent rings, row b's ring in slot b), so that it
can be compared with the original model.
"""

from __future__ import annotations

import torch

def identity_pages(batch: int, max_pages: int, num_pages: int) -> int:
    """Pages per sequence in the identity layout of `num_pages` pages over `batch` sequences:
    sequence b owns pages b * J .. b * J + J - 1, J = min(max_pages, num_pages // batch)."""
    return max(0, min(max_pages, num_pages // max(1, batch)))


def identity_page_table(batch: int, max_pages: int, num_pages: int, device=None) -> torch.Tensor:
    """int32 [batch, max_pages]: the identity layout (`identity_pages`); slots past J hold 0."""
    per = identity_pages(batch, max_pages, num_pages)
    table = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)
    if per:
        table[:, :per] = (torch.arange(batch, device=device)[:, None] * per + torch.arange(per, device=device)).to(torch.int32)
    return table


def cache_to_pages(cache: torch.Tensor, batch: int, num_pages: int, page_size: int, max_pages: int) -> torch.Tensor:
    """A static cache [B_max, Hkv, S, D] laid out as a pool [num_pages, Hkv, P, D] in the identity
    layout: positions [j * P, (j + 1) * P) of sequence b < batch in page b * J + j (J =
    `identity_pages`); pages no sequence owns (and the tail of a last, partial page) hold zeros.
    This is what a paged build stores for a cache's contents at build time; per-token fp8 scale
    buffers [B_max, Hkv, S] go the same way into pools [num_pages, Hkv, P]."""
    b_max, heads, length, *head_dim = cache.shape
    pool = torch.zeros(num_pages, heads, page_size, *head_dim, dtype=cache.dtype, device=cache.device)
    per = identity_pages(batch, max_pages, num_pages)
    padded = torch.zeros(b_max, heads, max_pages * page_size, *head_dim, dtype=cache.dtype, device=cache.device)
    padded[:, :, :length] = cache
    for b in range(min(batch, b_max)):
        for j in range(per):
            pool[b * per + j] = padded[b, :, j * page_size:(j + 1) * page_size]
    return pool


def rings_to_slots(rings: torch.Tensor, batch: int, slots: int) -> torch.Tensor:
    """exact-recent rings [B_max, Hkv, N, D] as a pool of `slots` rings in the identity layout:
    row b < batch's ring in slot b (what `identity_ring_slots` names), the other slots zeros."""
    pool = rings.new_zeros(slots, *rings.shape[1:])
    rows = min(batch, rings.shape[0], slots)
    pool[:rows] = rings[:rows]
    return pool


def identity_ring_slots(batch: int, device=None) -> torch.Tensor:
    """int32 [batch]: row b's ring in slot b (the layout `rings_to_slots` stored)."""
    return torch.arange(batch, dtype=torch.int32, device=device)


class StaticView(torch.nn.Module):
    """A paged build called as the static-cache model it was built from: `forward(*inputs)` is
    `program(*inputs, page_table)` with the identity page table (sequence b in pages b * J ..),
    the layout `cache_to_pages` stored the caches' contents in. The build's end-to-end check
    compares this with the original model; a call at a position the layout cannot hold (a pool
    smaller than the static caches) is refused.

    `_kernels` is the program's (bisection switches kernels through it)."""

    def __init__(self, program, paged: dict):
        super().__init__()
        self.program = program
        self.paged = paged
        self.per_sequence = identity_pages(paged["batch"], paged["max_pages"], paged["num_pages"])
        self.table = identity_page_table(paged["batch"], paged["max_pages"], paged["num_pages"])

    @property
    def _kernels(self):
        return self.program._kernels

    def forward(self, *inputs):
        positions = inputs[self.paged["positions"]]
        limit = self.per_sequence * self.paged["page_size"]
        if positions.numel() and int(positions.max()) >= limit:
            raise ValueError(f"positions up to {int(positions.max())}: the identity layout of {self.paged['num_pages']} pages "
                             f"holds {limit} positions per sequence (paged-kv num-pages too small to check the build "
                             f"against its static-cache original)")
        slots = () if self.paged.get("ring_slots") is None else (identity_ring_slots(self.paged["batch"], positions.device),)
        return self.program(*inputs, self.table.to(positions.device), *slots)
