"""Template families by name; built-ins import lazily, plugins add more (coopt.plugins)."""

from __future__ import annotations

import importlib

from coopt.templates.base import TemplateFamily

_BUILTIN = {
    "elementwise": "coopt.templates.elementwise:ElementwiseFamily",
    "row_reduction": "coopt.templates.row_reduction:RowReductionFamily",
    "matmul_epilogue": "coopt.templates.matmul_epilogue:MatmulEpilogueFamily",
    "gemv_cuda": "coopt.templates.gemv_cuda:GemvCudaFamily",
    "attention": "coopt.templates.attention:AttentionFamily",
    "decode_attention": "coopt.templates.decode_attention:DecodeAttentionFamily",
    "decode_attention_mma": "coopt.templates.decode_attention_mma:DecodeAttentionMmaFamily",
    "rope": "coopt.templates.rope:RopeFamily",
    "kv_write": "coopt.templates.kv_write:KvWriteFamily",
    "embedding_rows": "coopt.templates.embedding_rows:EmbeddingRowsFamily",
}


def _load(ref: str) -> type[TemplateFamily]:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def template_families() -> dict[str, TemplateFamily]:
    """All families (built-in and plugin), instantiated, keyed by name."""
    from coopt.plugins import plugin_templates

    families = {name: _load(ref)() for name, ref in _BUILTIN.items()}
    for name, cls in plugin_templates().items():
        families[name] = cls()
    return families


def families_for(region) -> list[TemplateFamily]:
    return [f for f in template_families().values() if f.matches(region)]
