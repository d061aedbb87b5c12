"""Sequences of different lengths decoded together over a paged build: add, step, release.

    built = coopt.load("out/llama-paged")      # a --paged-kv build whose step is ragged
    decoder = PagedDecoder(built)                # greedy; cuda_graph=True replays the step on the GPU
    a = decoder.add([1, 5, 7])                   # prefill through the pages; a's first token waits
    b = decoder.add(prompt_b, temperature=0.8, top_k=50)   # this sequence samples
    decoder.step()                               # {a: token, b: token}: one new token each
    decoder.release(a)                           # a's pages go back to the pool
    decoder.pages_in_use()                       # memory held: the pages live sequences hold

The build (`coopt build ... --paged-kv P`, docs/kv-cache.md) is a ragged decode step
`model(tokens [B, 1], positions [B], page_table [B, max_pages]) -> [B, 1, V]` over page pools
(its `paged` contract, PAGED in program.py), usually with a `prefill` entry point over the same
pools (`tokens [B, T], positions [T], page_table`). The decoder owns the pool's bookkeeping
(`coopt.runtime.pages.PageAllocator`, one page reserved as scratch for padding rows); the
pools themselves are the build's state buffers, written in place by its kernels (the K and V
pools, and with per-token fp8 scales the scale pools beside them: one page id names a page of
each, so the decoder's page table serves them all).

- add(prompt, temperature=None, top_k=None): takes the prompt's pages (all or nothing:
  PoolExhausted changes nothing), then prefills them through the prefill entry in chunks of the
  build's prefill chunk (else the longest call it takes), each chunk attending to the pages the
  chunks before it wrote; a tail shorter than the entry takes goes through the decode step.
  Without a prefill entry the prompt is fed token by token through the step. Row 0 of each call
  is the sequence; the batch's other rows are padding whose page tables name only the scratch
  page. The prompt's next token is chosen now and kept for the next step.
- step(): one new token for every live sequence: a sequence added since the last step emits
  the token its prefill chose; every other one takes one more position (all or nothing, before
  any model call) and is decoded, B rows per call (the build's batch; the last call padded).
  The calls' tokens stay on the device until all are queued: one host sync a step, not a call.
  Returns {seq_id: token} in the order the sequences were added.
- release(seq_id): returns the pages; UnknownSequence for an unknown or released id.

A build with fp8-kv-cache's exact-recent (`--kv-cache fp8-recent`) keeps each sequence's newest
rows in a ring slot of its own (the program's last input, ring_slots [B]): add() takes one of the
build's `num_ring_slots` - 1 (the last is the padding rows'), release() returns it, and an add()
with none free raises RingSlotsExhausted (a PoolExhausted: nothing changed, release and retry).
ring_bytes() is the rings' memory, allocated once beside the pages.

Tokens are chosen by `coopt.runtime.generate.sample`: greedy (argmax) at temperature 0, the
default; else sampled from softmax(logits / temperature), within the top_k most likely when
top_k is given. The decoder's `temperature` / `top_k` apply to every sequence unless add()
overrides them (None: the decoder's). Samples draw from one torch.Generator on the model's
device, seeded once with `seed` (which also orders the allocator's pages): the same seed, prompts
and sequence of calls give the same tokens. Greedy sequences draw nothing from it.

`cuda_graph=True` (a model on a CUDA device; else ValueError) captures the decode step once,
at construction, as a `coopt.runtime.cuda_graph.GraphedStep` over a batch of padding rows (its
warm-up calls write only the scratch page); every decode call then copies tokens, positions and
page table into the graph's static inputs and replays it. Shapes never change ([B, 1], [B],
[B, max_pages]: the build's batch, padded), so one graph serves every step; prefill-entry calls
stay plain calls and write the same pools the graph reads. Replays skip the build's value
checks: the decoder has checked positions (max_seq) and prompt ids, and the table is its own.

Imports torch only (and coopt.runtime): it runs from out/ without the compiler.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from coopt.runtime.cuda_graph import GraphedStep
from coopt.runtime.generate import check_sampling, sample
from coopt.runtime.pages import PageAllocator, PoolExhausted, UnknownSequence  # noqa: F401 (re-exported)


class RingSlotsExhausted(PoolExhausted):
    """Every exact-recent ring slot is held by a live sequence; the request changed nothing."""

    def __init__(self, slots: int):
        RuntimeError.__init__(self, f"a sequence needs an exact-recent ring slot but all {slots} are held by live "
                                    "sequences (nothing was allocated: release sequences and retry, or build with a "
                                    "larger paged-kv max-sequences)")
        self.needed, self.free = 1, 0


class PagedDecoder:
    """Continuous batching over a paged build: greedy by default, or sampled (per decoder or per
    sequence), with the decode step optionally replayed as a CUDA graph.

    >>> decoder = PagedDecoder(built, temperature=0.7, top_k=40, seed=1)  # doctest: +SKIP
    >>> a = decoder.add([1, 5, 7], temperature=0)                          # this one greedy
    """

    def __init__(self, model, *, prefill_chunk: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                 seed: int = 0, cuda_graph: bool = False):
        contract = getattr(model, "paged", None)
        if not isinstance(contract, dict) or not contract.get("per_row"):
            raise TypeError(f"{type(model).__name__} is not a paged ragged decode step: PagedDecoder needs a coopt build "
                            "with --paged-kv of a step forward(tokens [B, 1], positions [B]) (its `paged` contract)")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        check_sampling(temperature, top_k)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
        self.model, self.contract, self.prefill_chunk = model, contract, prefill_chunk
        self.temperature, self.top_k = float(temperature), top_k
        entry = getattr(model, "entry_points", {}).get("prefill")
        entry_contract = getattr(entry, "paged", None)
        same_pools = isinstance(entry_contract, dict) and all(
            entry_contract.get(k) == contract.get(k) for k in ("page_size", "num_pages", "max_pages", "pools", "rings",
                                                                "num_ring_slots"))
        self.prefill_entry = entry if same_pools and not entry_contract["per_row"] else None
        self.prefill_contract = entry_contract if self.prefill_entry is not None else None
        self.device = next(iter(model.buffers())).device
        self.pages = PageAllocator(contract["num_pages"], contract["page_size"], self.device, seed=seed, reserved=1)
        self.scratch = self.pages.reserved_pages[0]  # padding rows read and write only this page
        # exact-recent rings (fp8-kv-cache): one ring slot a live sequence, the last slot the
        # padding rows'; free slots are a stack (released ones reused first)
        slots = contract.get("num_ring_slots")
        self._free_slots = list(range(slots - 2, -1, -1)) if slots else None
        self.scratch_slot = slots - 1 if slots else None
        self._slot: dict[int, int] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(int(seed))  # every sample draws from it
        self._last: dict[int, int] = {}  # the last token of each sequence (fed by its next decode)
        self._pending: dict[int, int] = {}  # a prefilled sequence's first token, emitted by the next step
        self._sampling: dict[int, tuple[float, int | None]] = {}  # (temperature, top_k) per sequence added
        self.graph = self._capture() if cuda_graph else None

    # -- sequences ----------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, prompt, *, temperature: float | None = None, top_k: int | None = None) -> int:
        """Prefill a prompt (token ids, [T] or [1, T]) into new pages; returns the sequence id.
        `temperature` / `top_k` choose this sequence's tokens (None: the decoder's).

        Checked before anything changes: 1 <= T < max_seq (a position left to decode into),
        token ids in the vocabulary, the sampling arguments. PoolExhausted when the pool has too
        few free pages for T tokens: nothing was allocated."""
        tokens = self._prompt(prompt)
        sampling = (self.temperature if temperature is None else temperature, self.top_k if top_k is None else top_k)
        check_sampling(*sampling)
        seq_id = self._new_sequence(tokens.numel())
        self._sampling[seq_id] = (float(sampling[0]), sampling[1])
        try:
            logits = self._prefill(seq_id, tokens)
        except BaseException:
            self.release(seq_id)  # a failed prefill holds no pages (and no ring slot)
            raise
        self._pending[seq_id] = int(self._choose([seq_id], logits[None])[0])
        return seq_id

    @torch.no_grad()
    def step(self) -> dict[int, int]:
        """One new token for each live sequence: {seq_id: token}, oldest first."""
        live = self.pages.live_sequences()
        decode = [s for s in live if s not in self._pending]
        full = [s for s in decode if self.pages.length(s) >= self.contract["max_seq"]]
        if full:
            raise ValueError(f"sequence {full[0]} holds {self.contract['max_seq']} positions, all the build's "
                             f"caches address (max_seq): release it before the next step")
        chosen: dict[int, int] = {}
        if decode:
            positions = [self.pages.length(s) for s in decode]  # where this step's K/V go
            self.pages.step(decode)  # all or nothing: PoolExhausted changes nothing
            batch = self.contract["batch"]
            # Tokens stay on the device until every call is queued: one host sync a step, so the
            # host prepares call i + 1 while the GPU runs call i (each call's sampling is queued
            # before the next replay overwrites the logits it reads).
            tokens = []
            for start in range(0, len(decode), batch):
                group = decode[start:start + batch]
                logits = self._call_step(group, [self._last[s] for s in group], positions[start:start + batch])
                tokens.append(self._choose(group, logits))
            chosen = dict(zip(decode, torch.cat(tokens).tolist()))
        emitted = {}
        for seq_id in live:
            token = self._pending.pop(seq_id) if seq_id in self._pending else chosen[seq_id]
            self._last[seq_id] = emitted[seq_id] = token
        return emitted

    def _new_sequence(self, length: int) -> int:
        """A new sequence holding the pages of `length` positions and, with exact-recent rings, a
        ring slot: all or nothing (PoolExhausted, RingSlotsExhausted change nothing)."""
        if self._free_slots == []:
            raise RingSlotsExhausted(self.contract["num_ring_slots"] - 1)
        seq_id = self.pages.add_sequence(length)
        if self._free_slots is not None:
            self._slot[seq_id] = self._free_slots.pop()
        return seq_id

    def release(self, seq_id: int) -> None:
        """End a sequence: its pages return to the pool. UnknownSequence for an unknown or
        released id."""
        self.pages.release(seq_id)
        self._pending.pop(seq_id, None)
        self._last.pop(seq_id, None)
        self._sampling.pop(seq_id, None)
        if seq_id in self._slot:
            self._free_slots.append(self._slot.pop(seq_id))

    def live_sequences(self) -> list[int]:
        return self.pages.live_sequences()

    def length(self, seq_id: int) -> int:
        """Positions sequence `seq_id` holds in the cache (its prompt and the tokens decoded)."""
        return self.pages.length(seq_id)

    # -- memory ------------------------------------------------------------------------------
    def pages_in_use(self) -> int:
        """Pages held by live sequences (the scratch page not counted)."""
        return self.pages.pages_in_use()

    def bytes_per_page(self) -> int:
        """Bytes of one page over every pool of the build: K and V of every layer, and with
        per-token fp8 scales their scale pools [N, Hkv, P] (4 bytes a row)."""
        total = 0
        for name in self.contract["pools"]:
            pool = self.model.state_tensor(name)
            total += pool[0].numel() * pool.element_size()
        return total

    def bytes_held(self) -> int:
        """KV-cache bytes the live sequences hold: pages in use x bytes per page."""
        return self.pages_in_use() * self.bytes_per_page()

    def ring_bytes(self) -> int:
        """Bytes of the exact-recent ring pools (every slot of every ring: allocated once, held
        whatever the sequences), 0 without them."""
        return sum(self.model.state_tensor(name).nbytes for name in self.contract.get("rings", ()))

    # -- calls -------------------------------------------------------------------------------
    def _prompt(self, prompt) -> torch.Tensor:
        tokens = torch.as_tensor(prompt)
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(f"prompt: expected token ids [T] or [1, T], got {tokens.dtype} of shape {list(tokens.shape)}")
        length, max_seq = tokens.numel(), self.contract["max_seq"]
        if not 1 <= length < max_seq:
            raise ValueError(f"prompt: {length} tokens, but a sequence takes 1 to {max_seq - 1} (the caches hold "
                             f"{max_seq} positions and decoding needs one more)")
        vocab = self.contract.get("token_range")
        if vocab is not None:
            low, high = vocab
            smallest, largest = int(tokens.min()), int(tokens.max())
            if smallest < low or largest >= high:
                raise ValueError(f"prompt: holds {smallest if smallest < low else largest}, outside the vocabulary [{low}, {high})")
        return tokens.to(getattr(torch, self.contract["dtype"])).to(self.device)

    def _tables(self, seq_ids: Sequence[int], rows: int) -> torch.Tensor:
        """[rows, max_pages] int32: the sequences' page tables, then padding rows of scratch."""
        width = self.contract["max_pages"]
        table = torch.full((rows, width), self.scratch, dtype=torch.int32, device=self.device)
        if seq_ids:
            table[:len(seq_ids)] = self.pages.page_table(seq_ids, width, fill=self.scratch)
        return table

    def _tables_and_slots(self, seq_ids: Sequence[int], rows: int) -> tuple[torch.Tensor, ...]:
        """The page tables (`_tables`) and, with exact-recent rings, int32 [rows]: each
        sequence's ring slot, then the padding rows' scratch slot."""
        table = self._tables(seq_ids, rows)
        if self._free_slots is None:
            return (table,)
        slots = torch.full((rows,), self.scratch_slot, dtype=torch.int32)
        slots[:len(seq_ids)] = torch.tensor([self._slot[s] for s in seq_ids], dtype=torch.int32)
        return table, slots.to(self.device)

    def _call_step(self, seq_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """The ragged step over these sequences (padded to the build's batch): their logits [n, V]."""
        rows, count = self.contract["batch"], len(seq_ids)
        token_dtype = getattr(torch, self.contract["dtype"])
        token_rows = torch.zeros(rows, 1, dtype=token_dtype, device=self.device)
        position_rows = torch.zeros(rows, dtype=torch.int64, device=self.device)
        token_rows[:count, 0] = torch.tensor(list(tokens), dtype=token_dtype)
        position_rows[:count] = torch.tensor(list(positions), dtype=torch.int64)
        step = self.graph if self.graph is not None else self.model
        logits = step(token_rows, position_rows, *self._tables_and_slots(seq_ids, rows))[:count, -1]
        return logits.clone() if self.graph is not None else logits  # a replay overwrites the graph's output

    def _prefill(self, seq_id: int, tokens: torch.Tensor) -> torch.Tensor:
        """Write the prompt's keys and values into the sequence's pages; the last position's logits."""
        length = tokens.numel()
        entry = self.prefill_contract
        if entry is not None:
            shortest, longest = entry["length"]
            chunk = min(self.prefill_chunk or entry.get("prefill_chunk") or longest, longest)
        start, logits = 0, None
        while start < length:
            left = length - start
            if entry is not None and shortest <= min(left, chunk):
                size = min(left, chunk)
                logits = self._call_prefill(seq_id, tokens[start:start + size], start)
            else:  # token by token through the decode step
                size = 1
                logits = self._call_step([seq_id], [int(tokens[start])], [start])[0]
            start += size
        return logits

    def _call_prefill(self, seq_id: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """One chunk through the prefill entry at positions [start, start + T), row 0 the sequence."""
        rows = self.prefill_contract["batch"]
        chunk = torch.zeros(rows, tokens.numel(), dtype=tokens.dtype, device=self.device)
        chunk[0] = tokens
        positions = torch.arange(start, start + tokens.numel(), device=self.device)
        logits = self.prefill_entry(chunk, positions, *self._tables_and_slots([seq_id], rows))
        return logits[0, -1]

    def _choose(self, seq_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """The next token of each sequence from its row of `logits` [n, V], int64 [n] on the
        model's device (no host sync): one sample() call per (temperature, top_k) among them, in
        row order (so the generator's draws are reproducible)."""
        default = (self.temperature, self.top_k)
        rows_of: dict[tuple[float, int | None], list[int]] = {}
        for row, seq_id in enumerate(seq_ids):
            rows_of.setdefault(self._sampling.get(seq_id, default), []).append(row)
        if len(rows_of) == 1:  # one setting for every row (the usual case): no gather, no scatter
            (temperature, top_k), = rows_of
            return sample(logits, temperature, top_k, self.generator)[:, 0]
        tokens = torch.empty(len(seq_ids), dtype=torch.int64, device=logits.device)
        for (temperature, top_k), rows in rows_of.items():
            index = torch.tensor(rows, device=logits.device)
            tokens[index] = sample(logits[index], temperature, top_k, self.generator)[:, 0]
        return tokens

    def _capture(self) -> GraphedStep:
        """The decode step as a CUDA graph, captured over a batch of padding rows: its warm-up
        calls write position 0 of the scratch page, nothing a sequence reads."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"cuda_graph=True: CUDA graphs need a CUDA device, but the model is on {self.device} "
                             "(move it with .cuda(), or pass cuda_graph=False)")
        rows = self.contract["batch"]
        tokens = torch.zeros(rows, 1, dtype=getattr(torch, self.contract["dtype"]), device=self.device)
        positions = torch.zeros(rows, dtype=torch.int64, device=self.device)
        # check=False: the decoder checks positions and prompt ids itself; a replay then needs no host sync
        return GraphedStep(self.model, (tokens, positions, *self._tables_and_slots([], rows)), check=False)
