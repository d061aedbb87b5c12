"""PagedKVCache: pages taken as sequences grow and returned when they end, all-or-nothing
growth, clear errors for exhaustion and stale ids, rows stored where the page table says."""

from __future__ import annotations

import doctest
import random

import pytest
import torch

from coopt.runtime import paged
from coopt.runtime.paged import PagedKVCache, PoolExhausted, UnknownSequence


def make_cache(num_pages=8, page_size=16, dtype=torch.float32, **kwargs) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_pages=num_pages, num_kv_heads=2, page_size=page_size, head_dim=4,
                        dtype=dtype, **kwargs)


def state(cache: PagedKVCache) -> tuple:
    """Everything a failed request must leave unchanged."""
    live = cache.live_sequences()
    return (live, cache.lengths(live).tolist(), [cache.page_table([s]).tolist() for s in live],
            cache.free_pages(), cache.bytes_held())


def test_docstring_examples():
    result = doctest.testmod(paged)
    assert result.attempted > 0 and result.failed == 0


def test_pages_follow_the_length():
    cache = make_cache()
    a, b, c = cache.add_sequence(), cache.add_sequence(16), cache.add_sequence(17)
    assert cache.lengths([a, b, c]).tolist() == [0, 16, 17]
    assert cache.lengths([a, b, c]).dtype == torch.int32
    assert cache.pages_in_use() == 0 + 1 + 2
    cache.extend(a, 1)  # 1 token: a page
    cache.extend(a, 15)  # fills it: no new page
    assert cache.pages_in_use() == 4
    cache.extend(a, 1)  # crosses the page boundary
    assert cache.pages_in_use() == 5 and cache.lengths([a]).tolist() == [17]
    cache.extend(a, 0)
    assert cache.pages_in_use() == 5
    with pytest.raises(ValueError):
        cache.extend(a, -1)


def test_page_table_shape_and_padding():
    cache = make_cache()
    a, b = cache.add_sequence(40), cache.add_sequence(1)
    table = cache.page_table([a, b])
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert table[1, 1:].tolist() == [0, 0]  # unused slots
    pages = table[0].tolist() + table[1, :1].tolist()
    assert len(set(pages)) == 4 and all(0 <= p < 8 for p in pages)  # distinct pages of the pool
    assert cache.page_table([b, a]).tolist() == table.flip(0).tolist()  # rows in the order asked
    assert cache.page_table([a, b], max_pages=5).shape == (2, 5)
    with pytest.raises(ValueError):
        cache.page_table([a], max_pages=2)  # a holds 3 pages
    assert cache.page_table([cache.add_sequence()]).shape == (1, 1)  # at least one column


def test_page_table_rows_kept_between_calls_match_a_fresh_table():
    # page_table keeps each sequence's row between calls and writes only the pages taken since:
    # after every operation (steps across page edges, extends, releases and reuse of their
    # pages) its table equals the one a twin allocator, replayed the same operations and never
    # asked before, builds from scratch
    from coopt.runtime.pages import PageAllocator

    rng = random.Random(3)
    log: list[tuple] = []

    def replay() -> PageAllocator:
        twin = PageAllocator(64, 16, seed=5, reserved=1)
        for op, *args in log:
            getattr(twin, op)(*args)
        return twin

    pool = PageAllocator(64, 16, seed=5, reserved=1)
    for _ in range(60):
        live = pool.live_sequences()
        choice = rng.random()
        if not live or (choice < 0.2 and pool.free_pages() > 8):
            op = ("add_sequence", rng.randrange(0, 40))
        elif choice < 0.3:
            op = ("release", rng.choice(live))
        elif choice < 0.45:
            op = ("extend", rng.choice(live), rng.randrange(0, 20))
        else:
            op = ("step", live)
        try:
            getattr(pool, op[0])(*op[1:])
        except PoolExhausted:
            continue  # changed nothing (tested below); not logged
        log.append(op)
        live = pool.live_sequences()
        width, fill = (8, pool.reserved_pages[0]) if rng.random() < 0.8 else (10, 0)
        table = pool.page_table(live, width, fill=fill)
        assert table.tolist() == replay().page_table(live, width, fill=fill).tolist(), log
        table.fill_(-1)  # the caller's copy: the rows kept inside must not change with it
        assert pool.page_table(live, width, fill=fill).min().item() >= 0


def test_pages_are_not_handed_out_contiguously():
    cache = make_cache(num_pages=16)
    table = cache.page_table([cache.add_sequence(16 * 16)])[0].tolist()
    assert sorted(table) == list(range(16)) and table != list(range(16))


def test_step_grows_every_live_sequence():
    cache = make_cache()
    a, b = cache.add_sequence(15), cache.add_sequence(3)
    assert cache.step().tolist() == [15, 3]  # the new positions
    assert cache.lengths([a, b]).tolist() == [16, 4]
    assert cache.step([b]).tolist() == [4]
    with pytest.raises(ValueError):
        cache.step([a, a])


def test_exhaustion_is_recoverable_and_changes_nothing():
    cache = make_cache(num_pages=4)
    a, b = cache.add_sequence(33), cache.add_sequence(1)  # 3 + 1 pages: the pool is full
    before = state(cache)
    with pytest.raises(PoolExhausted) as error:
        cache.extend(b, 16)
    assert isinstance(error.value, RuntimeError)
    assert error.value.needed == 1 and error.value.free == 0
    assert "needs 1 pages but only 0 are free" in str(error.value)
    with pytest.raises(PoolExhausted):
        cache.add_sequence(1)
    assert state(cache) == before
    # a step needing pages for several sequences takes none when it cannot take all
    cache.release(b)
    c = cache.add_sequence(16)  # the freed page, full
    before = state(cache)
    with pytest.raises(PoolExhausted) as error:
        cache.step([a, c])  # a has room in its last page, c needs a page
    assert error.value.needed == 1
    assert state(cache) == before
    # releasing makes room; the same request then succeeds
    cache.release(a)
    assert cache.step([c]).tolist() == [16]
    d = cache.add_sequence(32)
    assert cache.lengths([c, d]).tolist() == [17, 32]
    assert cache.pages_in_use() == 4


def test_failed_add_takes_no_id():
    cache = make_cache(num_pages=1)
    with pytest.raises(PoolExhausted):
        cache.add_sequence(17)
    assert cache.add_sequence(16) == 0


def test_released_and_unknown_ids_are_errors():
    cache = make_cache()
    a = cache.add_sequence(5)
    cache.release(a)
    operations = {
        "release": lambda s: cache.release(s),
        "extend": lambda s: cache.extend(s, 1),
        "step": lambda s: cache.step([s]),
        "lengths": lambda s: cache.lengths([s]),
        "page_table": lambda s: cache.page_table([s]),
        "gather": lambda s: cache.gather(0, s),
        "write": lambda s: cache.write(0, [s], torch.tensor([0]), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4)),
    }
    for name, operation in operations.items():
        with pytest.raises(UnknownSequence, match="released already"):
            operation(a)
        with pytest.raises(UnknownSequence, match="never added"):
            operation(99)
    assert isinstance(UnknownSequence("x"), KeyError)
    assert cache.free_pages() == 8
    assert cache.add_sequence() != a  # ids are never reused


def test_bytes_held_and_capacity():
    cache = make_cache(num_pages=8, page_size=32, dtype=torch.bfloat16)
    assert cache.capacity_tokens() == 8 * 32
    page_bytes = 2 * 2 * 2 * 32 * 4 * 2  # K and V, 2 layers, 2 kv heads, 32 rows of D 4, bf16
    assert cache.bytes_per_page() == page_bytes and cache.bytes_held() == 0
    a, b = cache.add_sequence(1), cache.add_sequence(65)
    assert cache.bytes_held() == 4 * page_bytes  # 1 + 3 pages, not 2 x the longest
    cache.release(b)
    assert cache.bytes_held() == page_bytes
    cache.release(a)
    assert cache.bytes_held() == 0


def test_write_and_gather_through_shuffled_pages():
    # several sequences growing in turns, so their pages interleave in the pool
    cache = make_cache(num_pages=24, page_size=16)
    rng = random.Random(0)
    expected = {}
    seqs = [cache.add_sequence() for _ in range(3)]
    for _ in range(6):
        order = rng.sample(seqs, len(seqs))
        tokens = [rng.randint(1, 20) for _ in order]
        for seq, n in zip(order, tokens):
            start = cache.lengths([seq]).item()
            cache.extend(seq, n)
            positions = torch.arange(start, start + n)[None]
            k, v = torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)
            cache.write(1, [seq], positions, k, v)
            old_k, old_v = expected.get(seq, (torch.empty(2, 0, 4), torch.empty(2, 0, 4)))
            expected[seq] = (torch.cat([old_k, k[0]], 1), torch.cat([old_v, v[0]], 1))
    for seq in seqs:
        k, v = cache.gather(1, seq)
        assert k.shape == (2, cache.lengths([seq]).item(), 4)
        torch.testing.assert_close(k, expected[seq][0], rtol=0, atol=0)
        torch.testing.assert_close(v, expected[seq][1], rtol=0, atol=0)
        assert cache.gather(0, seq)[0].abs().max() == 0  # layer 0 untouched


def test_write_one_token_per_sequence_at_their_positions():
    cache = make_cache()
    a, b = cache.add_sequence(16), cache.add_sequence(2)
    positions = cache.step([a, b])
    k, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    cache.write(0, [a, b], positions, k, v)  # positions [B]: one token each
    torch.testing.assert_close(cache.gather(0, a)[0][:, 16], k[0, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(cache.gather(0, b)[1][:, 2], v[1, :, 0], rtol=0, atol=0)
    with pytest.raises(IndexError):
        cache.write(0, [b], torch.tensor([3]), k[:1], v[:1])  # past b's length
    with pytest.raises(ValueError):
        cache.write(0, [a, b], positions, k[:, :1], v)  # wrong shape


def test_fp8_pages_quantize_with_per_head_scales():
    k_scale, v_scale = torch.tensor([0.01, 0.02]), torch.tensor([[0.03, 0.04], [0.05, 0.06]])
    cache = make_cache(dtype=torch.float8_e4m3fn, k_scale=k_scale, v_scale=v_scale)
    assert cache.scales(1)[0].tolist() == pytest.approx([0.01, 0.02])
    assert cache.scales(1)[1].tolist() == pytest.approx([0.05, 0.06])
    seq = cache.add_sequence(20)
    k, v = torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4) * 100  # v saturates: clamped, not inf
    cache.write(1, [seq], torch.arange(20)[None], k, v)
    stored_k, _ = cache.gather(1, seq)
    assert stored_k.dtype == torch.float8_e4m3fn
    expected_k = (k[0] / k_scale[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(stored_k.view(torch.uint8), expected_k.view(torch.uint8))
    deq_k, deq_v = cache.gather(1, seq, dequantize=True)
    torch.testing.assert_close(deq_k, k[0], rtol=0.07, atol=1e-3)
    assert deq_v.abs().max() <= 448 * 0.06 + 1e-4 and torch.isfinite(deq_v).all()
    assert cache.bytes_per_page() == 2 * 2 * 2 * 16 * 4  # 1-byte elements


def test_fp8_pages_with_per_token_scales():
    """Each row's own scale max(absmax(row), 1e-12) * headroom / 448, kept in scale pages
    [N, Hkv, P] at the row's page and slot (what the paged kernels read after the table)."""
    cache = make_cache(num_pages=8, dtype=torch.float8_e4m3fn, granularity="per-token", headroom=1.25)
    k_scales, v_scales = cache.scales(0)
    assert k_scales.shape == (8, 2, 16) and k_scales.dtype == torch.float32 and v_scales is not k_scales
    a, b = cache.add_sequence(20), cache.add_sequence(3)
    k, v = torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4) * 1000
    k[0, 1, 7] = 0.0  # an all-zero row: the floor's scale, zeros stored
    cache.write(0, [a], torch.arange(20)[None], k, v)
    stored_k, _ = cache.gather(0, a)
    scale = k[0].abs().amax(-1).clamp_min(1e-12) * (1.25 / 448)  # [Hkv, 20]
    expected = (k[0] / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(stored_k.view(torch.uint8), expected.view(torch.uint8))
    page, slot = cache.page_table([a])[0, 7 // 16].item(), 7
    assert k_scales[page, 1, slot] == torch.tensor(1e-12) * (1.25 / 448) and not stored_k[1, 7].float().any()
    deq_k, deq_v = cache.gather(0, a, dequantize=True)
    torch.testing.assert_close(deq_k, k[0], rtol=0.07, atol=1e-6)
    torch.testing.assert_close(deq_v, v[0], rtol=0.07, atol=1e-3)  # large rows: their own scales
    assert cache.gather(0, b)[0].shape == (2, 3, 4) and not cache.scales(1)[0].any()  # layer 1 untouched
    # K and V of 2 layers: [Hkv, P, D] 1-byte rows and [Hkv, P] fp32 scales per page
    assert cache.bytes_per_page() == 2 * 2 * (2 * 16 * 4 + 2 * 16 * 4)
    with pytest.raises(ValueError, match="per-token"):
        make_cache(dtype=torch.float8_e4m3fn, granularity="per-token", k_scale=torch.ones(2), v_scale=torch.ones(2))
    with pytest.raises(ValueError, match="per-token"):
        make_cache(granularity="per-token")  # fp32 pages have no scales


def test_construction_errors():
    with pytest.raises(ValueError, match="page_size"):
        make_cache(page_size=24)
    with pytest.raises(ValueError, match="need per-head"):
        make_cache(dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="only for"):
        make_cache(k_scale=torch.ones(2), v_scale=torch.ones(2))
    with pytest.raises(ValueError, match="shape"):
        make_cache(dtype=torch.float8_e4m3fn, k_scale=torch.ones(3), v_scale=torch.ones(2))
