"""out/weights.pt + out/zeros.json (coopt/emit/state_file.py): all-zero tensors (a decode
build's KV caches) are stored as shape and dtype, made again with torch.zeros at load."""

import json

import pytest
import torch

from coopt.emit.state_file import ZEROS_FILE, save_state, stored_state


def test_all_zero_tensors_go_to_zeros_json_and_come_back_alike(tmp_path):
    shared = torch.zeros(4, 4)
    tensors = {
        "cache": torch.zeros(2, 3, 5, dtype=torch.bfloat16),
        "steps": torch.zeros(3, dtype=torch.int64),
        "weight": torch.randn(4, 4),
        "almost": torch.zeros(6).index_fill_(0, torch.tensor([5]), 1e-30),  # one nonzero element
        "tied_a": shared, "tied_b": shared,  # shared storage: torch.save keeps the tie, zeros.json could not
        "empty": torch.zeros(0, 3),
        "fp8_cache": torch.zeros(2, 4, dtype=torch.float8_e4m3fn),
        "negative_zero": torch.full((3,), -0.0),  # == 0, but torch.zeros would not remake its sign bits
        "strided": torch.zeros(4, 6)[:, ::2],
    }
    save_state(tensors, tmp_path)
    stored = torch.load(tmp_path / "weights.pt", weights_only=True)
    zeros = json.loads((tmp_path / ZEROS_FILE).read_text())
    assert set(zeros) == {"cache", "steps", "fp8_cache", "strided"}
    assert set(stored) == {"weight", "almost", "tied_a", "tied_b", "empty", "negative_zero"}
    assert zeros["cache"] == {"shape": [2, 3, 5], "dtype": "bfloat16"}
    assert stored["tied_a"].data_ptr() == stored["tied_b"].data_ptr()
    loaded = stored_state(tmp_path / "weights.pt", "cpu")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name  # bit for bit
    meta = stored_state(tmp_path / "weights.pt")
    assert meta["cache"].device.type == "meta" and meta["cache"].shape == (2, 3, 5)


class EmptyCache(torch.nn.Module):
    """A decode step over a KV cache that starts empty (zeros)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, 16, 8))
        self.register_buffer("v_cache", torch.zeros(1, 2, 16, 8))
        self.register_buffer("positions", torch.arange(16))

    def forward(self, q, k, v, input_pos):
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        mask = self.positions[None, :] <= input_pos[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)


def test_a_build_stores_its_empty_caches_as_zeros_json_and_loads_them_as_zeros(tmp_path):
    import coopt

    def step(pos):
        g = torch.Generator().manual_seed(pos)
        return (torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g),
                torch.randn(1, 2, 1, 8, generator=g), torch.tensor([pos]))

    eager = EmptyCache().eval()
    coopt.Pipeline("inplace-state-writes,raise-patterns", top_k=1).build(EmptyCache().eval(), step(0), tmp_path / "out")
    assert set(json.loads((tmp_path / "out" / ZEROS_FILE).read_text())) == {"k_cache", "v_cache"}
    assert not {"k_cache", "v_cache"} & set(torch.load(tmp_path / "out" / "weights.pt", map_location="meta", weights_only=True))
    built = coopt.load(tmp_path / "out", device="cpu")  # beside the eager model, also on a GPU machine
    assert built.state_tensor("k_cache").shape == (1, 2, 16, 8) and not built.state_tensor("k_cache").any()
    for pos in range(4):  # the loaded zeros are the cache the steps write and read
        torch.testing.assert_close(built(*step(pos)), eager(*step(pos)))
    # a build without its weights (bench/decode.py removes them unless --keep-weights): one line
    from coopt.errors import InputFileError

    (tmp_path / "out" / "weights.pt").unlink()
    with pytest.raises(InputFileError, match="has no weights.pt") as info:
        coopt.load(tmp_path / "out", device="cpu")
    assert info.value.exit_code == 9


def test_weights_that_do_not_fit_are_refused_before_writing(tmp_path, monkeypatch):
    """Fewer bytes free than the stored tensors' storages (each once; the all-zero cache is not
    stored) plus the margin: an
    OutputDirError naming both sizes and no weights.pt; a write that fails anyway (torch.save
    reports a full disk as a RuntimeError) becomes the same one-line error."""
    import shutil

    import pytest

    from coopt.emit import outdir
    from coopt.emit.state_file import stored_bytes
    from coopt.errors import OutputDirError

    weight = torch.randn(1000, 250)  # 1 MB
    tensors = {"w": weight, "tied": weight, "view": weight[:10], "cache": torch.zeros(4096)}
    assert stored_bytes([weight, weight, weight[:10]]) == 1_000_000  # one storage, counted once
    usage = shutil.disk_usage(tmp_path)
    margin = outdir._SPACE_MARGIN_BYTES
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=margin + 999_999))
    with pytest.raises(OutputDirError, match=r"the build's weights .*1\.0 MB needed"):
        save_state(tensors, tmp_path)
    assert not (tmp_path / "weights.pt").exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=margin + 1_000_000))

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 10048 vs 9942\nmore")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OutputDirError, match=r"cannot write .*weights\.pt.*unexpected pos 10048 vs 9942$"):
        save_state(tensors, tmp_path)
