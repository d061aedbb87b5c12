"""bench/repro_variants.py without a GPU: a repro whose candidate scales the last half of every
output row is replayed as built and under variants; the worst row's ratios show the half, and
only the variants that undo the scaling pass."""

from __future__ import annotations

from repro_variants import main
from test_fold_probe import module, region

from coopt.verify.repro import write_repro
from coopt.verify.strategies import Example


def test_variants_name_the_change_that_passes(tmp_path, monkeypatch, capsys):
    reference = module(tmp_path, "reference", write_first=True)
    source = reference.read_text().replace("    return k_cache, v_cache, out\n",
                                           "    out[..., 8:] *= 1.5 if BROKEN else 1.0\n    return k_cache, v_cache, out\n")
    candidate = tmp_path / "candidate.py"
    candidate.write_text(source + "\n\nBROKEN = 1\n")
    script = write_repro(region(), reference, candidate, Example((), seed=3, magnitude=1.0),
                         repro_dir=tmp_path / "repro", label="c0", failure="output 2: off")
    monkeypatch.setattr("sys.argv", ["repro_variants.py", str(script), "--knob", "BROKEN=0,1", "--knob", "ABSENT=2",
                                     "--replace", "*= 1.5=>*= 1.0", "--device", "cpu"])
    assert main() == 0
    head, as_built, off, on, absent, replaced = capsys.readouterr().out.splitlines()
    ratios = [float(r) for r in head.split("worst row: [")[1].rstrip("]").split(", ")]
    assert "output 2," in head and ratios == [1.0] * 8 + [1.5] * 8
    assert as_built.startswith("   as built: output 2: max abs err")
    assert off == "   BROKEN=0: passes" and on.startswith("   BROKEN=1: output 2: max abs err")
    assert absent == "   ABSENT=2: not applicable: the candidate has no such text"
    assert replaced == "   '*= 1.5' -> '*= 1.0': passes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["candidate.py", "reference.py", "repro"]  # variants removed
