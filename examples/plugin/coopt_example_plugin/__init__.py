"""An installable coopt plugin. The entry point `coopt.plugins` names the `plugin` object below;
coopt reads its `passes` (and could read `templates`, `advisors`, `targets`) dicts."""

from dataclasses import dataclass
from types import SimpleNamespace

from xdsl.dialects.builtin import IntegerAttr, ModuleOp, i64

from coopt.ir.dialect import FallbackOp
from coopt.passes.base import CooptPass
from coopt.passes.stats import count


@dataclass(frozen=True)
class TagFallbacks(CooptPass):
    """Marks every fallback op with its ordinal (a stand-in for real analysis) and counts them."""

    name = "tag-fallbacks"
    summary = "example plugin pass: number the ops that fell back to PyTorch"

    start: int = 0

    def apply(self, ctx, op: ModuleOp) -> None:
        for index, fallback in enumerate(o for o in op.walk() if isinstance(o, FallbackOp)):
            fallback.attributes["plugin.ordinal"] = IntegerAttr(self.start + index, i64)
            count("plugin.tag-fallbacks")


plugin = SimpleNamespace(passes={"tag-fallbacks": TagFallbacks})
