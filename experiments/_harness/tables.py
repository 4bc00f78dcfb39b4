"""Markdown cells every results table writes the same way, and a results file that keeps notes."""

from __future__ import annotations

import pathlib
import statistics

GIB = float(1 << 30)
#: Text below this line in a results file is written by hand and kept when the script reruns.
NOTES = "<!-- notes -->"


def fmt_ratio(
    stats: tuple[float, float, float], digits: int = 2, *, spread: int = 2, dash: str = "-"
) -> str:
    """'1.03 [0.98-1.10]': a (median, min, max) of per-round ratios (`timing.ratio_stats`)."""
    med, lo, hi = stats
    return f"{med:.{digits}f} [{lo:.{spread}f}{dash}{hi:.{spread}f}]"


def fine_ratio(stats: tuple[float, float, float]) -> str:
    """'1.031 [0.98–1.10]': `fmt_ratio` with a third digit, for ratios near 1 (the core and
    sharding benchmarks' targets are 2-3 %)."""
    return fmt_ratio(stats, 3, dash="–")


def mean_sd(values: list[float], scale: float = 1.0, digits: int = 4) -> str:
    """'0.9650 ± 0.0021' over seeds (sd 0 for one)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * statistics.mean(values):.{digits}f} ± {scale * sd:.{digits}f}"


def paired(diffs: list[float], digits: int = 2) -> str:
    """'+0.12 [-0.05, +0.30]': the mean of per-seed differences to a reference, and their range."""
    text = f"{statistics.mean(diffs):+.{digits}f}"
    if len(diffs) > 1:
        text += f" [{min(diffs):+.{digits}f}, {max(diffs):+.{digits}f}]"
    return text


def gib(nbytes: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{nbytes / GIB:.2f}"


def gib_parts(by: dict, floor: float, *, skip=(), empty: str = "-") -> str:
    """'f32 1.20, bf16 3.40': a {dtype: bytes} split in GiB, parts under `floor` bytes and those
    named in `skip` left out (`empty` where none is left)."""
    return (
        ", ".join(f"{k} {gib(v)}" for k, v in by.items() if v >= floor and k not in skip) or empty
    )


def write_keeping_notes(path, text: str) -> None:
    """Writes `text` to `path` followed by the NOTES line and, where the old file had them, the
    notes below it."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    notes = f"{NOTES}\n"
    if path.exists():
        old = path.read_text()
        notes = old[old.index(NOTES) :] if NOTES in old else notes
    path.write_text(text + "\n" + notes)


def write_page(path, lines: list[str], image: str = "") -> None:
    """Writes `lines` to the results page `path` and prints them; `image`, where given, is the alt
    text of the plot drawn beside the page (its .png), shown at its end."""
    path = pathlib.Path(path)
    if image:
        lines = [*lines, "", f"![{image}]({path.with_suffix('.png').name})"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
