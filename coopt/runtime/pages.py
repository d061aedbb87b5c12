"""Pages of a KV-cache pool and the sequences holding them: bookkeeping only, no tensors.

Runtime code: torch only. A pool of `num_pages` pages of `page_size` positions; a sequence holds
a list of page ids (its page table) and a length, taking pages as it grows and returning them
when released. `PagedKVCache` (coopt/runtime/paged.py) adds the K/V page tensors of L layers
(and per-token fp8 scale pages); `coopt.runtime.serve.PagedDecoder` uses the allocator over the
pools of a paged build. A page id names the same page of every pool (K, V, their scales).

Failures are explicit and leave the pool untouched:
- `PoolExhausted` (a RuntimeError): not enough free pages for a request. Nothing changed; the
  caller may release sequences and retry.
- `UnknownSequence` (a KeyError): an id never added, or already released. Ids are never reused.

    >>> pool = PageAllocator(num_pages=4, page_size=16, reserved=1)
    >>> a = pool.add_sequence(17)           # 2 pages
    >>> pool.pages_in_use(), pool.free_pages(), len(pool.reserved_pages)
    (2, 1, 1)
    >>> pool.add_sequence(20)
    Traceback (most recent call last):
    ...
    coopt.runtime.pages.PoolExhausted: a sequence of 20 tokens needs 2 pages but only 1 are free (nothing was allocated: release sequences and retry)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PAGE_SIZES = (16, 32, 64, 128, 256)


class PoolExhausted(RuntimeError):
    """The pool has fewer free pages than a request needs; the request changed nothing."""

    def __init__(self, needed: int, free: int, what: str):
        super().__init__(f"{what} needs {needed} pages but only {free} are free "
                         f"(nothing was allocated: release sequences and retry)")
        self.needed = needed
        self.free = free


class UnknownSequence(KeyError):
    """A sequence id that was never added, or was released already."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument; keep it readable
        return str(self.args[0]) if self.args else "unknown sequence"


class PageAllocator:
    """The pages of one pool and the sequences holding them.

    Page ids are handed out in a fixed pseudo-random order (`seed`), never contiguous by design:
    nothing may assume that a sequence's pages are adjacent. `reserved` pages are taken out of
    the pool at construction (`reserved_pages`: e.g. a scratch page the padding rows of a batch
    write into) and never counted as in use.
    """

    def __init__(self, num_pages: int, page_size: int, device: str | torch.device = "cpu", seed: int = 0,
                 reserved: int = 0):
        if page_size not in PAGE_SIZES:
            raise ValueError(f"page_size {page_size} is none of {PAGE_SIZES}")
        if num_pages < 1 or not 0 <= reserved < num_pages:
            raise ValueError(f"a pool of {num_pages} pages cannot reserve {reserved}: num_pages must be positive "
                             f"and more than the reserved pages")
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        # A stack: pop() takes the next page, release pushes pages back (reused first).
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self._free_pages: list[int] = order[::-1]
        self.reserved_pages = [self._free_pages.pop() for _ in range(reserved)]
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        # page_table's rows at a fixed width, kept per sequence between calls: (row, pages in it,
        # fill). A sequence's pages only grow until release, so each call writes just the pages
        # taken since the last (a decode step calls it every step; rebuilding 32 x 256 ids from
        # lists took 0.5 ms).
        self._table_rows: dict[int, tuple[torch.Tensor, int, int]] = {}
        self._released: set[int] = set()
        self._next_id = 0

    # -- sequences ------------------------------------------------------------------------
    def add_sequence(self, num_tokens: int = 0) -> int:
        """A new sequence holding `num_tokens` positions (pages taken now); returns its id.

        Raises PoolExhausted (and adds nothing) when the pool cannot hold them."""
        needed = self._pages_for(num_tokens)
        self._check_free(needed, f"a sequence of {num_tokens} tokens")
        seq_id = self._next_id
        self._next_id += 1
        self._pages[seq_id] = [self._free_pages.pop() for _ in range(needed)]
        self._lengths[seq_id] = num_tokens
        return seq_id

    def extend(self, seq_id: int, n: int) -> None:
        """Grow sequence `seq_id` by `n` positions, taking pages as needed (all or nothing)."""
        self._require(seq_id)
        if n < 0:
            raise ValueError(f"cannot extend by {n} tokens")
        self._grow({seq_id: n})

    def step(self, seq_ids: Sequence[int] | None = None) -> torch.Tensor:
        """One more position for each sequence (default: every live one), all or nothing.

        Returns the new positions, int64 [B], in `seq_ids` order: where this step's K/V go."""
        seq_ids = self.live_sequences() if seq_ids is None else list(seq_ids)
        for seq_id in seq_ids:
            self._require(seq_id)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a step lists a sequence twice: {seq_ids}")
        positions = [self._lengths[s] for s in seq_ids]
        self._grow(dict.fromkeys(seq_ids, 1))
        return torch.tensor(positions, dtype=torch.int64, device=self.device)

    def release(self, seq_id: int) -> None:
        """End sequence `seq_id`: its pages return to the pool; the id is never valid again."""
        self._require(seq_id)
        self._free_pages.extend(reversed(self._pages.pop(seq_id)))
        self._table_rows.pop(seq_id, None)
        del self._lengths[seq_id]
        self._released.add(seq_id)

    def live_sequences(self) -> list[int]:
        """Ids of the sequences added and not released, oldest first."""
        return list(self._lengths)

    # -- what the kernel reads --------------------------------------------------------------
    def lengths(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """Valid positions of each sequence, int32 [B]."""
        return torch.tensor([self._lengths[self._require(s)] for s in seq_ids], dtype=torch.int32,
                            device=self.device)

    def page_table(self, seq_ids: Sequence[int], max_pages: int | None = None, fill: int = 0) -> torch.Tensor:
        """Page ids of each sequence, int32 [B, max_pages]; slots past a sequence's pages hold
        `fill` (never read: the kernel stops at the length; a reserved scratch page keeps even a
        stray read off other sequences' pages). `max_pages` fixes the width (e.g. for a CUDA
        graph); by default the most pages any of these sequences holds (at least 1)."""
        tables = [self._pages[self._require(s)] for s in seq_ids]
        width = max([1, *(len(t) for t in tables)]) if max_pages is None else max_pages
        if any(len(t) > width for t in tables):
            raise ValueError(f"max_pages={width} is fewer than a sequence holds")
        if not tables:
            return torch.empty(0, width, dtype=torch.int32, device=self.device)
        return torch.stack([self._table_row(s, t, width, fill) for s, t in zip(seq_ids, tables)]).to(self.device)

    def _table_row(self, seq_id: int, pages: list[int], width: int, fill: int) -> torch.Tensor:
        """Sequence `seq_id`'s page table row (CPU int32 [width]), updated with the pages it took
        since the last call at this width and fill."""
        row, written, row_fill = self._table_rows.get(seq_id, (None, 0, fill))
        if row is None or row.numel() != width or row_fill != fill:
            row, written = torch.full((width,), fill, dtype=torch.int32), 0
        if len(pages) > written:
            row[written:len(pages)] = torch.tensor(pages[written:], dtype=torch.int32)
        self._table_rows[seq_id] = (row, len(pages), fill)
        return row

    def length(self, seq_id: int) -> int:
        """Positions sequence `seq_id` holds."""
        return self._lengths[self._require(seq_id)]

    # -- accounting ------------------------------------------------------------------------
    def pages_in_use(self) -> int:
        """Pages held by live sequences (reserved pages not counted)."""
        return self.num_pages - len(self.reserved_pages) - len(self._free_pages)

    def free_pages(self) -> int:
        return len(self._free_pages)

    def capacity_tokens(self) -> int:
        """Positions the whole pool can hold (every page full)."""
        return self.num_pages * self.page_size

    # -- internals -------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"a sequence cannot hold {num_tokens} tokens")
        return -(-num_tokens // self.page_size)

    def _check_free(self, needed: int, what: str) -> None:
        if needed > len(self._free_pages):
            raise PoolExhausted(needed, len(self._free_pages), what)

    def _grow(self, growth: dict[int, int]) -> None:
        """Lengthen several sequences at once: every page is checked for before any is taken."""
        needed = {s: self._pages_for(self._lengths[s] + n) - len(self._pages[s]) for s, n in growth.items()}
        total = sum(needed.values())
        self._check_free(total, f"growing {len(growth)} sequence(s) by {sum(growth.values())} tokens")
        for seq_id, n in growth.items():
            self._pages[seq_id].extend(self._free_pages.pop() for _ in range(needed[seq_id]))
            self._lengths[seq_id] += n

    def _require(self, seq_id: int) -> int:
        if seq_id in self._lengths:
            return seq_id
        if seq_id in self._released:
            raise UnknownSequence(f"sequence {seq_id} was released already")
        raise UnknownSequence(f"sequence {seq_id} was never added")
