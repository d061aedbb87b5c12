"""A Llama layer written the way transformers writes it, in bf16: LlamaRMSNorm (fp32 statistics
between two casts), the rotary tables computed in the model (cos and sin of the same angles, cast
to bf16), keys and values repeated per query head (repeat_kv) before SDPA. It builds as the
project's own Llama does: every norm a GEMV prologue, the attention grouped over the kv heads
(no copy of repeated keys), nothing between the kernels but the table's small data ops."""

import torch
import torch.nn.functional as F
from built_calls import beside_eager

import coopt

D, H, KV, HD, FF = 64, 4, 2, 16, 96


class LlamaRMSNorm(torch.nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(1 + 0.1 * torch.randn(size)), eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def repeat_kv(x, n_rep):
    batch, heads, length, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, n_rep, length, dim).reshape(batch, heads * n_rep, length, dim)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj = torch.nn.Linear(D, H * HD, bias=False), torch.nn.Linear(D, KV * HD, bias=False)
        self.v_proj, self.o_proj = torch.nn.Linear(D, KV * HD, bias=False), torch.nn.Linear(H * HD, D, bias=False)
        self.gate_proj, self.up_proj = torch.nn.Linear(D, FF, bias=False), torch.nn.Linear(D, FF, bias=False)
        self.down_proj = torch.nn.Linear(FF, D, bias=False)
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(D), LlamaRMSNorm(D)
        self.to(torch.bfloat16)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD)), persistent=False)

    def forward(self, x, position_ids):
        angles = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, H, HD).transpose(1, 2)
        k = self.k_proj(h).view(b, s, KV, HD).transpose(1, 2)
        v = self.v_proj(h).view(b, s, KV, HD).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, repeat_kv(k, H // KV), repeat_kv(v, H // KV), is_causal=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, H * HD))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def test_it_builds_as_the_projects_own_llama(tmp_path):
    model = Layer()
    inputs = (torch.randn(2, 8, D, dtype=torch.bfloat16), torch.arange(8)[None].expand(2, 8))
    result = coopt.Pipeline(top_k=1).build(model, inputs, tmp_path / "out")
    counters = result.counters
    assert counters["raise.attention.repeated_kv_folded"] == 1 and counters["fuse.attention.gqa"] == 1
    assert counters["raise.rms_norm.explicit.fp32_statistics"] == 2
    families = sorted(r.summary.family for r in result.regions)
    assert families.count("attention") == 1 and "row_reduction" not in families  # both norms are prologues
    # between the kernels: only the table's cat (the positions' int -> float cast fuses with the angles)
    assert set(result.unfused_ops) <= {"aten.cat.default"}, result.unfused_ops
    assert not result.fallback_ops and result.e2e["ok"]
    x = torch.randn(2, 8, D, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(x, inputs[1]).float(), model(x, inputs[1]).float(),
                                   rtol=3e-2, atol=3e-2)


class DecodeLayer(Layer):
    """The same layer decoding one token over a static cache as transformers' StaticCache does:
    the rows written with index_copy_ at cache_position, the float mask built in the forward
    (0 up to the position, the dtype's minimum after it), the cache repeated per query head."""

    def __init__(self, batch=2, max_seq=16):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, KV, max_seq, HD, dtype=torch.bfloat16))
        self.register_buffer("v_cache", torch.zeros(batch, KV, max_seq, HD, dtype=torch.bfloat16))

    def forward(self, x, cache_position):
        b, s, _ = x.shape
        length = self.k_cache.shape[2]
        mask = torch.full((s, length), fill_value=torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
        mask *= torch.arange(length, device=x.device) > cache_position.reshape(-1, 1)
        mask = mask[None, None, :, :].expand(b, 1, -1, -1)
        angles = cache_position[None, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, H, HD).transpose(1, 2)
        k = self.k_proj(h).view(b, s, KV, HD).transpose(1, 2)
        v = self.v_proj(h).view(b, s, KV, HD).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        self.k_cache.index_copy_(2, cache_position, k)
        self.v_cache.index_copy_(2, cache_position, v)
        attn = F.scaled_dot_product_attention(q, repeat_kv(self.k_cache, H // KV), repeat_kv(self.v_cache, H // KV),
                                              attn_mask=mask[:, :, :, :length])
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, H * HD))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def test_its_static_cache_decode_step_reads_only_the_valid_keys(tmp_path):
    x = torch.randn(2, 1, D, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    result = coopt.Pipeline(top_k=1).build(DecodeLayer(), (x, torch.tensor([4])), tmp_path / "out")
    counters = result.counters
    assert counters["raise.attention.decode.additive_mask"] == 1 and counters["inplace.index_copy"] == 2
    # one decode attention reading lengths = position + 1, the rows' write (and K's rope) folded in
    assert counters["fuse.kv_write_attention"] == 1 and counters["raise.rms_norm.explicit.fp32_statistics"] == 2
    families = [r.summary.family for r in result.regions]
    assert families.count("decode_attention") == 1 and not {"attention", "kv_write"} & set(families)
    assert not result.fallback_ops and result.e2e["ok"]
    built, eager = coopt.load(tmp_path / "out"), DecodeLayer()
    device = built.w_k_cache.device
    eager.to(device)
    built.w_k_cache.zero_()
    built.w_v_cache.zero_()
    with torch.no_grad():
        for pos in range(6):  # each step reads the rows the steps before it wrote
            step = (torch.randn(2, 1, D, dtype=torch.bfloat16).to(device), torch.tensor([pos], device=device))
            torch.testing.assert_close(built(*step).float(), eager(*step).float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(built.w_k_cache.float(), eager.k_cache.float(), rtol=3e-2, atol=3e-2)
