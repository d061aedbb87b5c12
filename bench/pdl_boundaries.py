"""What PDL gains or costs at each launch of a decode step: two launch tables of one build
(bench/profile_step.py --launches --out, once with COOPT_PDL=0 and once with PDL on) side by side,
each launch's gap plus duration averaged over the layers.

    python bench/pdl_boundaries.py OFF.json ON.json

A launch is named by where it sits in its layer: its kernel and how many launches after the
layer's attention it comes ("attention +1" is the o GEMV in the Llama step), or before the first
attention / after the last one. Gap plus duration is the time from the previous launch's end to
this one's: under PDL a launch starts before its predecessor ends (a negative gap) and its
duration holds its wait, so neither alone says what PDL did (session 52: o after the CUDA
attention lost 0.8 µs a layer while its gap shrank by 0.8).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def positions(names: list[str], anchor: str = "attention") -> list[str]:
    """Each launch's place in its layer: "<anchor> +k" for the k-th launch after the latest launch
    whose name contains `anchor` (+0 is that launch), "before <anchor> k" ahead of the first such
    launch, "after the last <anchor> +k" past the last one (the last layer's tail and the output
    head, which no position tells apart from the next layer's first launches)."""
    marks = [i for i, name in enumerate(names) if anchor in name]
    if not marks:
        return [f"launch {i}" for i in range(len(names))]
    labels = []
    for i in range(len(names)):
        latest = max((m for m in marks if m <= i), default=None)
        if latest is None:
            labels.append(f"before {anchor} {i}")
        elif latest == marks[-1] and i > latest:
            labels.append(f"after the last {anchor} +{i - latest}")
        else:
            labels.append(f"{anchor} +{i - latest}")
    return labels


def boundaries(off: list[dict], on: list[dict], anchor: str = "attention") -> list[dict]:
    """One row per place in a layer (positions), first seen first: the kernel, how many launches
    share the place, and gap, duration and their sum (µs), means over them, without and with PDL;
    `gain_us` is what PDL took off the sum (negative: what it cost)."""
    if [launch["name"] for launch in off] != [launch["name"] for launch in on]:
        raise ValueError("the two tables launch different kernels: profiles of two different builds?")
    rows: dict[str, dict] = {}
    for place, a, b in zip(positions([launch["name"] for launch in off], anchor), off, on):
        row = rows.setdefault(place, {"place": place, "name": a["name"], "count": 0,
                                      "off": [0.0, 0.0], "on": [0.0, 0.0]})
        row["count"] += 1
        for side, launch in (("off", a), ("on", b)):
            row[side][0] += launch["gap_us"]
            row[side][1] += launch["us"]
    table = []
    for row in rows.values():
        (gap_off, us_off), (gap_on, us_on) = ([v / row["count"] for v in row[s]] for s in ("off", "on"))
        table.append({"place": row["place"], "name": row["name"], "count": row["count"],
                      "off": {"gap_us": gap_off, "us": us_off, "sum_us": gap_off + us_off},
                      "on": {"gap_us": gap_on, "us": us_on, "sum_us": gap_on + us_on},
                      "gain_us": (gap_off + us_off) - (gap_on + us_on)})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| place (kernel) | launches | without PDL: gap + µs | with PDL: gap + µs | PDL's gain µs |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in table:
        off, on = row["off"], row["on"]
        lines.append(f"| {row['place']} ({row['name'][:40]}) | {row['count']} | "
                     f"{off['gap_us']:.2f} + {off['us']:.2f} = {off['sum_us']:.2f} | "
                     f"{on['gap_us']:.2f} + {on['us']:.2f} = {on['sum_us']:.2f} | {row['gain_us']:+.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("off", type=Path, help="profile_step.py --launches --out JSON, COOPT_PDL=0")
    parser.add_argument("on", type=Path, help="the same build's, with PDL on")
    parser.add_argument("--anchor", default="attention", help="the kernel name that starts a layer")
    args = parser.parse_args()
    off, on = (json.loads(path.read_text()) for path in (args.off, args.on))
    print(f"replayed step: {off['replay_us']:.1f} µs without PDL ({off['pdl']}), {on['replay_us']:.1f} with ({on['pdl']})")
    print(markdown(boundaries(off["launches"], on["launches"], args.anchor)))


if __name__ == "__main__":
    main()
