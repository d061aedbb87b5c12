"""Paged KV cache: a pool of fixed-size pages and a page table per sequence (issue 4, slice 1).

Runtime code: torch only. Each of the L layers owns K and V page tensors
`[num_pages, Hkv, page_size, D]` (fp8 pages with per-token scales also K and V scale pages
`[num_pages, Hkv, page_size]` fp32, one scale per row, paged alike); a sequence owns a list of
page ids (its page table) and a length. Sequence b's position p lives at `k_pages[page_table[b, p // page_size], :, p % page_size]`,
which is what the paged `decode_attention` kernel reads (coopt/templates/decode_attention.py).
Pages are taken as a sequence grows and returned when it is released, so the memory held is
proportional to the tokens held (rounded up to whole pages per sequence).

Failures are explicit and leave the pool untouched:
- `PoolExhausted` (a RuntimeError): not enough free pages for a request. Nothing changed; the
  caller may release sequences and retry.
- `UnknownSequence` (a KeyError): an id never added, or already released (releasing twice,
  writing to or reading a released sequence). Ids are never reused.

Example (2 layers, 8 pages of 16 tokens, 2 kv heads, D 4):
    >>> cache = PagedKVCache(num_layers=2, num_pages=8, num_kv_heads=2, page_size=16, head_dim=4,
    ...                      dtype=torch.float32)
    >>> a = cache.add_sequence(20)          # 2 pages
    >>> b = cache.add_sequence()            # no page yet
    >>> cache.extend(b, 1)                  # 1 page
    >>> cache.lengths([a, b]).tolist(), cache.pages_in_use()
    ([20, 1], 3)
    >>> cache.page_table([a, b]).shape      # [B, max pages]; unused slots hold 0
    torch.Size([2, 2])
    >>> positions = cache.step([a, b])      # one more token each: their positions
    >>> positions.tolist()
    [20, 1]
    >>> k = v = torch.ones(2, 2, 1, 4)      # [B, Hkv, T, D]
    >>> cache.write(0, [a, b], positions, k, v)
    >>> cache.gather(0, b)[0].shape         # K of sequence b, layer 0: [Hkv, length, D]
    torch.Size([2, 2, 4])
    >>> cache.release(a)
    >>> cache.pages_in_use()
    1
    >>> cache.release(a)
    Traceback (most recent call last):
    ...
    coopt.runtime.pages.UnknownSequence: sequence 0 was released already
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from coopt.runtime.pages import PAGE_SIZES, PageAllocator, PoolExhausted, UnknownSequence  # noqa: F401 (re-exported)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-12  # a row's absmax floor (fp8-kv-cache's): an all-zero row still gets a nonzero scale
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)
GRANULARITIES = ("per-head", "per-token")


class PagedKVCache(PageAllocator):
    """K/V pages for `num_layers` layers, shared by all sequences through per-sequence page tables.

    dtype: bf16 / fp16 / fp32, or float8_e4m3fn with `k_scale`, `v_scale` (fp32, per head:
    `[Hkv]` for every layer or `[num_layers, Hkv]`), or with `granularity="per-token"` (no
    k_scale / v_scale): each row's own scale s = max(absmax(row), 1e-12) * headroom / 448, kept
    in scale pages [num_pages, Hkv, page_size] beside the row (fp8-kv-cache's per-token scales).
    fp8 pages store clamp(x / s, -448, 448) rounded to nearest even, and are read as page * s.
    Page ids are handed out in a fixed pseudo-random order (`seed`), never contiguous by design:
    nothing may assume that a sequence's pages are adjacent.
    """

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, seed: int = 0,
                 granularity: str = "per-head", headroom: float = 1.0):
        if page_size not in PAGE_SIZES:
            raise ValueError(f"page_size {page_size} is none of {PAGE_SIZES}")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype {dtype} is none of {CACHE_DTYPES}")
        if granularity not in GRANULARITIES or not float(headroom) >= 1.0:
            raise ValueError(f"granularity {granularity!r} must be one of {GRANULARITIES} and headroom {headroom} >= 1")
        if min(num_layers, num_pages, num_kv_heads, head_dim) < 1:
            raise ValueError("num_layers, num_pages, num_kv_heads and head_dim must be positive")
        super().__init__(num_pages, page_size, device, seed)
        self.num_layers = num_layers
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        self.key_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.value_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.per_token, self.headroom = granularity == "per-token", float(headroom)
        if self.per_token:  # one fp32 scale per row, in pages of their own indexed like the rows'
            if dtype != FP8_DTYPE or k_scale is not None or v_scale is not None:
                raise ValueError(f"per-token scales are for {FP8_DTYPE} pages and computed per row: no k_scale / v_scale")
            self.key_scale_pages, self.value_scale_pages = (
                [torch.zeros(shape[:3], dtype=torch.float32, device=self.device) for _ in range(num_layers)] for _ in "kv")
            self.k_scale = self.v_scale = None
        else:
            self.k_scale = self._layer_scales(k_scale, "k_scale")
            self.v_scale = self._layer_scales(v_scale, "v_scale")

    def _layer_scales(self, scale, name: str) -> torch.Tensor | None:
        """[num_layers, Hkv] fp32 scales for an fp8 pool, None otherwise."""
        if self.dtype != FP8_DTYPE:
            if scale is not None:
                raise ValueError(f"{name} is only for {FP8_DTYPE} pages, not {self.dtype}")
            return None
        if scale is None:
            raise ValueError(f"{FP8_DTYPE} pages need per-head {name} [Hkv] or [num_layers, Hkv]")
        scale = torch.as_tensor(scale, dtype=torch.float32)
        if scale.shape == (self.num_kv_heads,):
            scale = scale.expand(self.num_layers, -1)
        if scale.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"{name} shape {tuple(scale.shape)} is neither [{self.num_kv_heads}] "
                             f"nor [{self.num_layers}, {self.num_kv_heads}]")
        if not bool((scale > 0).all()):  # checked where the caller's values are, then moved
            raise ValueError(f"{name} must be positive")
        return scale.to(self.device).contiguous()

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of `layer`, [num_pages, Hkv, page_size, D] each."""
        return self.key_pages[layer], self.value_pages[layer]

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 K and V scales of `layer` (fp8 pools only): per head [Hkv], or per token the
        scale pages [num_pages, Hkv, page_size] (what the paged kernels take after the table)."""
        if self.per_token:
            return self.key_scale_pages[layer], self.value_scale_pages[layer]
        if self.k_scale is None:
            raise ValueError(f"a {self.dtype} pool has no scales")
        return self.k_scale[layer], self.v_scale[layer]

    # -- rows ------------------------------------------------------------------------------
    def write(self, layer: int, seq_ids: Sequence[int], positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store K/V rows: k, v [B, Hkv, T, D] at `positions` [B, T] ([B] when T is 1).

        Positions must lie inside each sequence's length (extend or step first). fp8 pools
        quantize with the layer's per-head scales, or per token with each row's own scale,
        stored at the row's page and slot of the scale pages. A reference implementation (torch
        indexing)."""
        seq_ids = list(seq_ids)
        positions = torch.as_tensor(positions, device=self.device).to(torch.int64)
        if positions.dim() == 1:
            positions = positions[:, None]
        batch, tokens = positions.shape
        expected = (batch, self.num_kv_heads, tokens, self.head_dim)
        if len(seq_ids) != batch or tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"write of {len(seq_ids)} sequences at positions {tuple(positions.shape)} "
                             f"needs k, v {list(expected)}, got {list(k.shape)} / {list(v.shape)}")
        lengths = self.lengths(seq_ids).to(self.device, torch.int64)[:, None]
        if bool(((positions < 0) | (positions >= lengths)).any()):
            raise IndexError(f"positions {positions.tolist()} outside the lengths {lengths.flatten().tolist()}")
        table = self.page_table(seq_ids).to(torch.int64)
        page_ids = table.gather(1, positions // self.page_size).flatten()
        slots = (positions % self.page_size).flatten()
        for which, (pages, rows) in enumerate(((self.key_pages[layer], k), (self.value_pages[layer], v))):
            rows = rows.to(self.device).permute(0, 2, 1, 3).reshape(-1, self.num_kv_heads, self.head_dim)
            if self.per_token:  # [N, Hkv] scales of the rows, stored beside them
                scale = rows.float().abs().amax(-1).clamp_min(SCALE_FLOOR) * (self.headroom / FP8_MAX)
                self.scales(layer)[which][page_ids, :, slots] = scale
                scale = scale[:, :, None]
            else:
                scale = None if self.k_scale is None else (self.k_scale, self.v_scale)[which][layer][None, :, None]
            pages[page_ids, :, slots] = self._store_form(rows, scale)

    def _store_form(self, rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Rows [N, Hkv, D] as the pages store them (fp8: x / s clamped to e4m3's range, s
        broadcast against the rows)."""
        if scale is None:
            return rows.to(self.dtype)
        return (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(self.dtype)

    def gather(self, layer: int, seq_id: int, dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K and V of one sequence, [Hkv, length, D] each, as stored (for tests and
        references); `dequantize` returns fp8 pages as fp32 page * scale."""
        length = self._lengths[self._require(seq_id)]
        page_ids = torch.tensor(self._pages[seq_id], dtype=torch.int64, device=self.device)
        result = []
        for which, pages in enumerate(self.pages(layer)):
            rows = pages[page_ids].permute(1, 0, 2, 3).reshape(self.num_kv_heads, -1, self.head_dim)[:, :length]
            if dequantize and self.per_token:
                scale = self.scales(layer)[which][page_ids].permute(1, 0, 2).reshape(self.num_kv_heads, -1)[:, :length]
                rows = rows.float() * scale[:, :, None]
            elif dequantize and self.k_scale is not None:
                rows = rows.float() * self.scales(layer)[which][:, None, None]
            result.append(rows.contiguous())
        return result[0], result[1]

    # -- accounting ------------------------------------------------------------------------
    def bytes_per_page(self) -> int:
        """K and V bytes of one page over all layers (with per-token scales, their fp32 scale
        pages too)."""
        row_bytes = self.head_dim * self.dtype.itemsize + (4 if self.per_token else 0)
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * row_bytes

    def bytes_held(self) -> int:
        """Bytes of the pages held by live sequences: proportional to the pages in use."""
        return self.pages_in_use() * self.bytes_per_page()
