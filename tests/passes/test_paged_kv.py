"""paged-kv: the caches of a ragged decode step (and of a prompt over the cache) become page
pools read and written through a page_table input; fusion takes the paged attention and the
paged writes into decode_attention / kv_write regions in paged mode, whose references compute
exactly what the static-cache step computed for the same contents."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from xdsl.dialects import func

from coopt.codegen.torch_lines import Names, block_lines, reference_module_source
from coopt.ir.summary import name_regions
from coopt.errors import ConfigError
from coopt.ir.dialect import StateUpdateOp, WeightOp
from coopt.passes.paged_kv import PAGED_ATTR, PagedKv
from coopt.passes.registry import parse_pipeline_text
from coopt.runtime.kernel_loader import load_module_from_source
from coopt.runtime.paged_layout import cache_to_pages, identity_page_table
from pass_helpers import kernels, run_pipeline
from test_ragged_decode import RaggedStep, inputs

RAISE = "inplace-state-writes,raise-patterns"
PAGED = RAISE + ",paged-kv{page-size=16}"
FUSED = PAGED + ",fuse-attention,fuse-kv-write,fuse-rope"


class PromptStep(torch.nn.Module):
    """A prompt over the cache (shared positions [T], the whole batch written)."""

    def __init__(self, b_max=2, max_seq=40):
        super().__init__()
        self.register_buffer("k_cache", torch.randn(b_max, 2, max_seq, 8))
        self.register_buffer("v_cache", torch.randn(b_max, 2, max_seq, 8))
        self.register_buffer("cache_positions", torch.arange(max_seq))

    def forward(self, q, k, v, pos):
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        mask = self.cache_positions[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def prompt_inputs(t=5, start=14):
    torch.manual_seed(1)
    return [torch.randn(2, 4, t, 8), torch.randn(2, 2, t, 8), torch.randn(2, 2, t, 8), torch.arange(start, start + t)]


def forward_args(module):
    fn = next(op for op in module.walk() if isinstance(op, func.FuncOp))
    return [a.type for a in fn.body.block.args]


def test_the_caches_become_pools_and_the_page_table_an_input():
    module, counters = run_pipeline(RaggedStep(), inputs(), PAGED)
    assert counters["paged_kv.caches"] == 2 and counters["paged_kv.writes"] == 2 and counters["paged_kv.attention_reads"] == 2
    pools = {op.ref.data: op.results[0].type.get_shape() for op in module.walk() if isinstance(op, WeightOp)
             and op.ref.data.endswith("cache")}
    assert pools == {"k_cache": (6, 2, 16, 8), "v_cache": (6, 2, 16, 8)}  # B_max 3 x cdiv(32, 16) pages
    table = forward_args(module)[-1]
    assert table.get_shape() == (3, 2) and str(table.element_type) == "i32"
    record = json.loads(module.attributes[PAGED_ATTR].data)
    assert record == {"page_size": 16, "num_pages": 6, "max_pages": 2, "batch": 3, "max_seq": 32, "per_row": True,
                      "pools": {"k_cache": [6, 2, 16, 8], "v_cache": [6, 2, 16, 8]}, "page_table_input": 6,
                      "positions_input": 5}


def test_fusion_reads_and_writes_through_the_page_table():
    module, counters = run_pipeline(RaggedStep(), inputs(), FUSED)
    assert counters["fuse.decode_attention.paged"] == 1 and counters["fuse.kv_write.paged"] == 1
    regions = {k.family.data: k for k in kernels(module)}
    attention, write = regions["decode_attention"], regions["kv_write"]
    assert attention.family_attrs["page_size"] == 16 and attention.family_attrs["page_table_input"] == 4
    assert [v.type.get_shape() for v in attention.inputs] == [(3, 4, 1, 8), (6, 2, 16, 8), (6, 2, 16, 8), (3,), (3, 2)]
    assert write.family_attrs == {"rope": True, "quant": "none", "inplace": [0, 1], "positions": "per-row",
                                  "index_input": 2, "index_bound": [7, 1], "page_size": 16, "page_table_input": 7,
                                  "pool_input": 0}
    # nothing gathers the pages outside the regions: the kernels read and write through the table
    assert not [op for op in module.walk() if getattr(op, "target", None) is not None
                and op.target.data == "aten.index.Tensor" and op.parent_op() not in (attention, write)
                and op.results[0].type.get_shape()[1:2] == (2,)]


def run_program(module, weights: dict, inputs: list, tmp_path):
    """The module's forward as eager torch code, every region on its reference module."""
    name_regions(module)
    fn = next(op for op in module.walk() if isinstance(op, func.FuncOp))
    runs = {k.sym_name.data: load_module_from_source(reference_module_source(k), tmp_path, k.sym_name.data).run
            for k in kernels(module)}
    names = Names()
    params = [names.new(a) for a in fn.body.block.args]
    lines, returned = block_lines(fn.body.block, names, weight_expr=lambda n: f"W[{n!r}]",
                                  state_expr=lambda n: f"W[{n!r}]", kernel_expr=lambda r: f"K[{r!r}]")
    source = f"import math\nimport operator\nimport torch\n\ndef run(W, K, {', '.join(params)}):\n"
    source += "    _device = torch.device('cpu')\n" + "".join(f"    {line}\n" for line in lines)
    source += f"    return {returned[0]}\n"
    namespace = {}
    exec(compile(source, "program", "exec"), namespace)
    return namespace["run"](weights, runs, *inputs)


@pytest.mark.parametrize("step,args,pipeline", [(RaggedStep, inputs, FUSED),
                                                (PromptStep, prompt_inputs, PAGED + ",fuse-attention,fuse-kv-write")],
                         ids=["ragged", "prompt"])
def test_references_match_the_static_step_in_the_identity_layout(tmp_path, step, args, pipeline):
    """The whole paged program (regions on their references) against the static-cache step: the
    pools hold the caches' contents in the identity layout (what the build stores)."""
    torch.manual_seed(0)
    eager = step()
    module, _ = run_pipeline(step(), args(), pipeline)
    record = json.loads(module.attributes[PAGED_ATTR].data)
    layout = (record["batch"], record["num_pages"], 16, record["max_pages"])
    table = identity_page_table(record["batch"], record["max_pages"], record["num_pages"])
    weights = {"cache_positions": eager.cache_positions,
               **{name: cache_to_pages(getattr(eager, name), *layout) for name in ("k_cache", "v_cache")}}
    got = run_program(module, weights, [*args(), table], tmp_path)
    torch.testing.assert_close(got, eager(*args()), rtol=1e-5, atol=1e-5)
    for name in ("k_cache", "v_cache"):  # the written pages hold what the static step wrote
        torch.testing.assert_close(weights[name], cache_to_pages(getattr(eager, name), *layout))


def test_a_prompt_over_pages_reads_through_the_table():
    module, counters = run_pipeline(PromptStep(), prompt_inputs(), PAGED + ",fuse-attention,fuse-kv-write")
    assert counters["paged_kv.caches"] == 2 and counters["fuse.kv_write.paged"] == 1
    assert counters["fuse.attention.paged"] == 1 and not counters["fuse.decode_attention.paged"]
    record = json.loads(module.attributes[PAGED_ATTR].data)
    assert record["per_row"] is False and record["batch"] == 2 and record["max_pages"] == 3
    # the prompt's attention region takes the pools and the table: nothing gathers the pages
    regions = {k.family.data: k for k in kernels(module)}
    attention = regions["attention"]
    assert attention.family_attrs["page_size"] == 16 and attention.family_attrs["page_table_input"] == 4
    assert [v.type.get_shape() for v in attention.inputs][1:] == [(6, 2, 16, 8), (6, 2, 16, 8), (5,), (2, 3)]
    assert not [op for op in module.walk() if getattr(op, "target", None) is not None
                and op.target.data == "aten.index.Tensor" and op.parent_op() not in regions.values()
                and op.results[0].type.get_shape()[1:2] == (3,)]


def test_knobs_and_refusals():
    assert parse_pipeline_text("paged-kv{page-size=32 num-pages=7}") == [PagedKv(32, 7)]
    for bad in ("page-size=8", "page-size=48", "num-pages=-1"):
        with pytest.raises(ConfigError, match="paged-kv: knob"):
            parse_pipeline_text(f"paged-kv{{{bad}}}")
    with pytest.raises(ConfigError, match="run paged-kv before the fusion passes"):
        run_pipeline(RaggedStep(), inputs(), RAISE + ",fuse-attention,fuse-kv-write,paged-kv")


def test_num_pages_sizes_the_pools():
    module, _ = run_pipeline(RaggedStep(), inputs(), RAISE + ",paged-kv{page-size=16 num-pages=4}")
    assert json.loads(module.attributes[PAGED_ATTR].data)["num_pages"] == 4
    assert {op.results[0].type.get_shape() for op in module.walk() if isinstance(op, WeightOp)
            and op.ref.data.endswith("cache")} == {(4, 2, 16, 8)}
    assert not [op for op in module.walk() if isinstance(op, StateUpdateOp) and op.inputs[0].type.get_shape()[0] == 3]


def _fp8_paged(pipeline_tail: str, knobs: str = ""):
    """The ragged step through fp8-kv-cache (per-head, calibrated; `knobs` added) and paged-kv."""
    from xdsl.context import Context

    from coopt.fp8_cache import calibrate_kv_absmax, set_calibration
    from coopt.frontend.capture import capture
    from coopt.frontend.importer import import_program
    from coopt.passes.stats import collect_counters

    model = RaggedStep().eval()
    module = import_program(capture(model, tuple(inputs())), tuple(inputs())).module
    set_calibration(module, calibrate_kv_absmax(model, [inputs()]))
    with collect_counters() as counters:
        for compiler_pass in parse_pipeline_text(RAISE + f",fp8-kv-cache{knobs},paged-kv{{page-size=16}}" + pipeline_tail):
            compiler_pass.apply(Context(allow_unregistered=True), module)
            module.verify()
    return module, counters


def test_fp8_pages_quantize_each_rows_write_and_fuse():
    module, counters = _fp8_paged(",fuse-attention,fuse-kv-write")
    assert counters["fp8_kv_cache.quantized_writes"] == 2 and counters["paged_kv.caches"] == 2
    assert {str(op.results[0].type.element_type) for op in module.walk() if isinstance(op, WeightOp)
            and op.ref.data in ("k_cache", "v_cache")} == {"f8E4M3FN"}
    regions = {k.family.data: k for k in kernels(module)}
    write, attention = regions["kv_write"], regions["decode_attention"]
    assert write.family_attrs["quant"] == "per-head" and write.family_attrs["page_size"] == 16
    assert attention.family_attrs["kv_scale"] == "per-head" and attention.family_attrs["page_size"] == 16
    # the write quantizes the [B, Hkv, 1, D] rows before selecting each sequence's one row
    body = [getattr(op, "target", None) and op.target.data or type(op).__name__ for op in write.body.block.ops]
    assert body.count("QuantizeFp8Op") == 2 and body.count("aten.select.int") == 2


# -- per-token fp8 scales (fp8-kv-cache{granularity=per-token}) paged with their caches ----------

PER_TOKEN = RAISE + ",fp8-kv-cache{granularity=per-token,scale-source=dynamic}"
FUSION = ",fuse-attention,fuse-kv-write,fuse-rope"


def test_per_token_scale_buffers_become_pools_paged_like_their_caches():
    module, counters = run_pipeline(RaggedStep(), inputs(), PER_TOKEN + ",paged-kv{page-size=16}" + FUSION)
    assert counters["paged_kv.caches"] == counters["paged_kv.scale_buffers"] == 2
    assert counters["paged_kv.writes"] == counters["paged_kv.attention_reads"] == 4  # the scales' too
    record = json.loads(module.attributes[PAGED_ATTR].data)
    assert record["pools"] == {"k_cache": [6, 2, 16, 8], "v_cache": [6, 2, 16, 8], "k_cache.scale": [6, 2, 16],
                               "v_cache.scale": [6, 2, 16]}
    regions = {k.family.data: k for k in kernels(module)}
    attention, write = regions["decode_attention"], regions["kv_write"]
    assert counters["fuse.decode_attention.paged"] == 1 and counters["fuse.kv_write.paged"] == 1
    assert counters["fuse.kv_write.per_token"] == 1
    # the kernels take the scale pools and read / write them through the one page table
    assert [v.type.get_shape() for v in attention.inputs[4:]] == [(3, 2), (6, 2, 16), (6, 2, 16)]
    assert [v.owner.ref.data for v in write.inputs[7:9]] == ["k_cache.scale", "v_cache.scale"]
    assert write.family_attrs["inplace"] == [0, 1, 7, 8] and write.family_attrs["page_table_input"] == 9
    assert not [op for op in module.walk() if getattr(op, "target", None) is not None
                and op.target.data == "aten.index.Tensor" and op.parent_op() not in (attention, write)]


@pytest.mark.parametrize("step,args", [(RaggedStep, inputs), (PromptStep, prompt_inputs)], ids=["ragged", "prompt"])
def test_per_token_references_match_the_static_step_in_the_identity_layout(tmp_path, step, args):
    """The paged per-token program (regions on their references) against the static per-token
    program over the same fp8 contents: the same output, and pools holding, in the identity
    layout, what the static caches and scale buffers hold after the step."""
    from coopt.fp8_cache import fp8_weights

    torch.manual_seed(0)
    eager = step()
    state = dict(eager.named_buffers())
    static, _ = run_pipeline(step(), args(), PER_TOKEN + FUSION)
    paged, _ = run_pipeline(step(), args(), PER_TOKEN + ",paged-kv{page-size=16}" + FUSION)
    fp8 = fp8_weights({"granularity": "per-token", "headroom": 1.0,
                       "caches": {"k_cache": "k_cache.scale", "v_cache": "v_cache.scale"}}, state)
    record = json.loads(paged.attributes[PAGED_ATTR].data)
    layout = (record["batch"], record["num_pages"], 16, record["max_pages"])
    table = identity_page_table(record["batch"], record["max_pages"], record["num_pages"])
    static_weights = {"cache_positions": eager.cache_positions, **{n: t.clone() for n, t in fp8.items()}}
    paged_weights = {"cache_positions": eager.cache_positions, **{n: cache_to_pages(t, *layout) for n, t in fp8.items()}}
    want = run_program(static, static_weights, args(), tmp_path / "static")
    got = run_program(paged, paged_weights, [*args(), table], tmp_path / "paged")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name in fp8:
        assert torch.equal(paged_weights[name].float(), cache_to_pages(static_weights[name], *layout).float()), name


def test_per_token_scales_that_cannot_be_paged_are_refused():
    from xdsl.context import Context

    from coopt.errors import ConfigError
    from coopt.ir.dialect import AtenOp
    from xdsl.rewriter import InsertPoint, Rewriter

    module, _ = run_pipeline(RaggedStep(), inputs(), PER_TOKEN)
    scale = next(op for op in module.walk() if isinstance(op, WeightOp) and op.ref.data == "v_cache.scale")
    reader = AtenOp("aten.clone.default", {"args": [{"$t": 0}], "kwargs": {}}, [scale.results[0]], [scale.results[0].type])
    Rewriter.insert_op(reader, InsertPoint.after(scale))  # something else reads V's scales
    with pytest.raises(ConfigError, match="v_cache.scale"):
        parse_pipeline_text("paged-kv{page-size=16}")[0].apply(Context(allow_unregistered=True), module)


# -- exact-recent rings (fp8-kv-cache{exact-recent=N}) paged as ring slots ------------------------

EXACT = RAISE + ",fp8-kv-cache{granularity=per-token,scale-source=dynamic,exact-recent=2}"


def test_exact_recent_rings_become_pools_read_through_ring_slots():
    """Each ring [B_max, Hkv, N, D] becomes a pool of ring slots [R, Hkv, N, D] and the program
    takes ring_slots [B] int32 after the page table; the decode attention reads the pools through
    it, and its ring write stays in the kernel, at the row's slot."""
    module, counters = run_pipeline(RaggedStep(), inputs(), EXACT + ",paged-kv{page-size=16 max-sequences=5}" + FUSION)
    assert counters["paged_kv.rings"] == 2 and counters["fuse.decode_attention.paged_rings"] == 1
    assert counters["fuse.decode_attention.ring_write"] == 1
    record = json.loads(module.attributes[PAGED_ATTR].data)
    assert record["rings"] == {"k_cache.recent": [5, 2, 2, 8], "v_cache.recent": [5, 2, 2, 8]}
    assert record["ring_slots"] == 5 and record["ring_slots_input"] == 7 and record["page_table_input"] == 6
    slots = forward_args(module)[-1]
    assert slots.get_shape() == (3,) and str(slots.element_type) == "i32"
    attention = next(k for k in kernels(module) if k.family.data == "decode_attention")
    attrs = attention.family_attrs
    assert attrs["ring_slots_input"] == len(attention.inputs) - 1 and attrs["ring_write"]["per_row"]
    rings = attention.inputs[attrs["exact_rows_input"] + 2:attrs["exact_rows_input"] + 4]
    assert [r.owner.ref.data for r in rings] == ["k_cache.recent", "v_cache.recent"]
    assert attention.inputs[-1] is next(op for op in module.walk() if isinstance(op, func.FuncOp)).body.block.args[-1]
    # the default: a slot a page, at most 256
    module, _ = run_pipeline(RaggedStep(), inputs(), EXACT + ",paged-kv{page-size=16}")
    assert json.loads(module.attributes[PAGED_ATTR].data)["ring_slots"] == 6


def test_too_few_ring_slots_are_refused():
    with pytest.raises(ConfigError, match="max-sequences=2 is under 3"):
        run_pipeline(RaggedStep(), inputs(), EXACT + ",paged-kv{page-size=16 max-sequences=2}")
    for bad in ("-1", "1"):
        with pytest.raises(ConfigError, match="knob max-sequences"):
            parse_pipeline_text(f"paged-kv{{max-sequences={bad}}}")


@pytest.mark.parametrize("step,args", [(RaggedStep, inputs), (PromptStep, prompt_inputs)], ids=["ragged", "prompt"])
def test_exact_recent_references_match_the_static_step_through_shuffled_ring_slots(tmp_path, step, args):
    """The paged exact-recent program (regions on their references) against the static one over
    the same fp8 contents, each row's ring in a shuffled slot of a larger pool: the same output
    (so every row read its own ring), and each slot holding what the static program's row's ring
    holds after the step (so every row wrote its own)."""
    from coopt.fp8_cache import fp8_record, fp8_weights

    torch.manual_seed(0)
    eager = step()
    state = dict(eager.named_buffers())
    for name in ("k_cache", "v_cache"):  # every row of the caches written: the rings' rows defined
        state[name] = state[name].clone()
    static, _ = run_pipeline(step(), args(), EXACT + FUSION)
    paged, _ = run_pipeline(step(), args(), EXACT + ",paged-kv{page-size=16 max-sequences=7}" + FUSION)
    fp8 = fp8_weights(fp8_record(static), state)
    record = json.loads(paged.attributes[PAGED_ATTR].data)
    layout = (record["batch"], record["num_pages"], 16, record["max_pages"])
    table = identity_page_table(record["batch"], record["max_pages"], record["num_pages"])
    slots = torch.tensor([5, 0, 3][:record["batch"]], dtype=torch.int32)
    static_weights = {"cache_positions": eager.cache_positions, **{n: t.clone() for n, t in fp8.items()}}
    paged_weights = {"cache_positions": eager.cache_positions}
    for name, tensor in fp8.items():
        if name in record["rings"]:
            pool = torch.full((7, *tensor.shape[1:]), float("nan"), dtype=tensor.dtype)
            pool[slots.long()] = tensor[:record["batch"]]  # other slots: NaN, which no row may read
            paged_weights[name] = pool
        else:
            paged_weights[name] = cache_to_pages(tensor, *layout)
    want = run_program(static, static_weights, args(), tmp_path / "static")
    got = run_program(paged, paged_weights, [*args(), table, slots], tmp_path / "paged")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # (a prompt's padded keys: another sum order)
    for name in record["rings"]:
        assert torch.equal(paged_weights[name][slots.long()], static_weights[name][:record["batch"]]), name
