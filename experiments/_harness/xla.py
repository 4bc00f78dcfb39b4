"""What XLA made of a compiled step (shared by the CPU benchmarks' tables)."""

from __future__ import annotations

import collections
import re


def hlo_summary(text: str) -> str:
    """Counts dots / convolutions by operand dtypes and by whether they run in a YNN fusion."""
    types, comp_of, ynn_comps, ops = {}, {}, set(), []
    comp = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) \(.*\{$", line)
        if head:
            comp = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[.*?\]\S* (\w+)\((.*?)\)", line)
        if not m:
            continue
        name, dtype, op, args = m.groups()
        types[name], comp_of[name] = dtype, comp
        if op == "fusion" and "__ynn_fusion" in line:
            ynn_comps.add(re.search(r"calls=%(\S+?),", line).group(1))
        if op in ("dot", "convolution", "convert"):
            ops.append((name, op, dtype, [a.strip().lstrip("%") for a in args.split(",")]))
    counts = collections.Counter()
    for name, op, out, args in ops:
        if op == "convert":
            counts["convert"] += 1
            continue
        where = "ynn" if comp_of[name] in ynn_comps else "xla"
        counts[f"{op} {'x'.join(types.get(a, '?') for a in args)}->{out} {where}"] += 1
    return "; ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
