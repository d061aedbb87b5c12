"""Pipeline strings: knobs parse, and every mistake names the culprit in one line."""

import pytest

from coopt.errors import ConfigError
from coopt.passes.registry import DEFAULT_PIPELINE, parse_pipeline_text


def test_default_pipeline_parses_with_knobs():
    passes = parse_pipeline_text(DEFAULT_PIPELINE + ",fuse-elementwise{max-ops=3}")
    assert passes[-1].name == "fuse-elementwise" and passes[-1].max_ops == 3


@pytest.mark.parametrize(
    "text, message",
    [
        ("raise-patterns,no-such-pass", "unknown pass 'no-such-pass'"),
        ("fuse-elementwise{bogus=1}", "unknown knob 'bogus' for pass 'fuse-elementwise'; its knobs: max-ops, min-ops"),
        ("fuse-elementwise{max-ops=many}", "bad knob value for pass 'fuse-elementwise'"),
        ("fuse-elementwise{", "malformed pipeline string"),
    ],
)
def test_errors_name_the_culprit(text, message):
    with pytest.raises(ConfigError) as info:
        parse_pipeline_text(text)
    assert message in info.value.message and info.value.exit_code == 5
