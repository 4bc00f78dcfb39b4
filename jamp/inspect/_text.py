"""Plain-text tables for the inspect reports: aligned columns, SI units, one line per row.

Example::

  print(format_table(["module", "FLOPs"], [["Dense_0", si(2.1e6)]]))
"""

from __future__ import annotations

import math


def si(n: float) -> str:
    """1234567 -> "1.23M"; 0 -> "0"."""
    if not n:
        return "0"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def nbytes(n: float) -> str:
    """1536 -> "1.5 KiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def percent(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}%"


def format_table(header: list[str], rows: list[list[str]], right: tuple[int, ...] = ()) -> str:
    """Columns padded to their widest cell; the columns in `right` are right-aligned."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(cells):
        out = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows])


def _by(counts: dict, unit: str = "") -> str:
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {si(v)}{unit}" for k, v in items if v) or "-"


def _label(path: str) -> str:
    return path or "(root)"


def report_table(report) -> str:
    """The text of a `jamp.inspect.report.Report`."""
    lines = [f"precision report: compute {report.compute_dtype}, activations {report.activations}"]
    if report.hardware:
        lines.append(f"hardware: {report.hardware}")
    rows = []
    for r in report.rows:
        kept = dict(r.kept_fp32)
        kept_text = _by(kept)
        if r.kept_fp32_flops:
            flops_text = _by(r.kept_fp32_flops, " FLOPs")
            kept_text = flops_text if kept_text == "-" else f"{kept_text}; {flops_text}"
        rows.append(
            [
                _label(r.path),
                {"forward": "fwd", "backward": "bwd"}.get(r.phase, r.phase),
                si(r.flops),
                percent(r.flops_16bit / r.flops if r.flops else float("nan")),
                ", ".join(str(k) for k in r.matmul_flops) or "-",
                _by(r.elementwise),
                kept_text,
            ]
        )
    header = ["module", "pass", "matmul FLOPs", "16-bit", "matmuls", "elementwise", "kept fp32"]
    lines += ["", format_table(header, rows, right=(2, 3)), ""]
    lines += _totals_lines(report.totals)
    lines += _hazard_lines(report.hazards)
    if report.gemms:
        kinds: dict[str, int] = {}
        for g in report.gemms:
            key = f"{g.kind} {'*'.join(g.operands)}->{g.result}"
            kinds[key] = kinds.get(key, 0) + 1
        lines.append("compiled GEMMs: " + ", ".join(f"{n} x {k}" for k, n in kinds.items()))
    return "\n".join(lines)


def _totals_lines(t) -> list[str]:
    total = sum(t.matmul_flops.values())
    phases = ", ".join(f"{p} {percent(t.share_16bit(p))}" for p, n in t.matmul_flops.items() if n)
    upcast = sum(t.matmul_flops_upcast.values())
    widened = f"; {percent(upcast / total)} widened to f32 on this device" if upcast else ""
    lines = [
        f"matmul FLOPs: {si(total)}, {percent(t.share_16bit())} with 16-bit operands "
        f"({phases}{widened})" + (f", {percent(t.share_fp8())} fp8" if t.share_fp8() > 0 else ""),
        "values produced: "
        + (", ".join(f"{d} {nbytes(n)}" for d, n in sorted(t.activation_bytes.items())) or "-"),
        f"elementwise work: {_by(t.elementwise)} elements",
    ]
    if t.collective_bytes:
        moved = ", ".join(f"{k} {nbytes(n)}" for k, n in sorted(t.collective_bytes.items()))
        lines.append(f"collectives: {moved}")
    return lines


def _hazard_lines(hazards) -> list[str]:
    if not hazards:
        return ["hazards: none"]
    lines = [f"hazards ({len(hazards)}):"]
    shown: dict[str, int] = {}
    for h in hazards:
        shown[h.kind] = shown.get(h.kind, 0) + 1
        if shown[h.kind] > _MAX_PER_KIND:
            continue
        amount = ""
        if h.amount:
            unit = " FLOPs" if "matmul" in h.kind or "accumulation" in h.kind else ""
            amount = f" [{si(h.amount)}{unit}]"
        lines.append(f"  ! {h}{amount}")
    for kind, n in shown.items():
        if n > _MAX_PER_KIND:  # the report's .hazards holds them all
            lines.append(f"  ! ... and {n - _MAX_PER_KIND} more {kind} hazards")
    return lines


_MAX_PER_KIND = 6
