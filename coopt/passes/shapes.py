"""Shape facts fusion legality needs (symbolic dims compare by name)."""

from __future__ import annotations

from xdsl.dialects.builtin import DYNAMIC_INDEX, ArrayAttr, StringAttr, TensorType
from xdsl.ir import SSAValue


def dims(value: SSAValue) -> list:
    """Shape as a list of ints and symbol names."""
    t = value.type
    names = [a.data for a in t.encoding.data] if t.encoding is not None and hasattr(t.encoding, "data") else None
    return [names[i] if d == DYNAMIC_INDEX else d for i, d in enumerate(t.get_shape())]


def broadcasts_to(value: SSAValue, target: SSAValue) -> bool:
    """numpy broadcasting of `value` to exactly `target`'s shape (never growing the target)."""
    small, big = dims(value), dims(target)
    if len(small) > len(big):
        return False
    return all(s == 1 or s == b for s, b in zip(reversed(small), reversed(big)))


def typed(element, shape: list) -> TensorType:
    """A tensor type from dims (ints, or symbol names for dynamic dims, kept in its encoding)."""
    sizes = [d if isinstance(d, int) else DYNAMIC_INDEX for d in shape]
    if all(isinstance(d, int) for d in shape):
        return TensorType(element, sizes)
    return TensorType(element, sizes, ArrayAttr([StringAttr("" if isinstance(d, int) else d) for d in shape]))
