"""What XLA made of a compiled step, and which machine it ran on (shared by the benchmarks)."""

from __future__ import annotations

import collections
import os
import platform
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


def cpu_description() -> str:
    """Model name, family/model and the 16-bit instruction sets of this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            block = f.read().split("\n\n")[0]
    except OSError:
        return platform.processor() or platform.machine()
    info = dict(ln.split(":", 1) for ln in block.splitlines() if ":" in ln)
    info = {k.strip(): v.strip() for k, v in info.items()}
    wanted = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
    flags = [f for f in wanted if f in info.get("flags", "").split()]
    return (
        f"{info.get('model name', platform.machine())} (family {info.get('cpu family', '?')} "
        f"model {info.get('model', '?')}; {', '.join(flags) or 'no 16-bit vector ISA'})"
    )


def machine_name() -> str:
    """A file-name-safe name of the accelerator (or CPU) and its count, e.g. 'cpu-amd-epyc-2c'."""
    import jax  # here, so that the accuracy scripts can describe the CPU without importing jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        label, count = cpu_description().split(" (")[0], os.cpu_count()
        kind = f"cpu-{label}-{count}c"
    else:
        kind = f"{device.device_kind}-x{jax.device_count()}"
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
