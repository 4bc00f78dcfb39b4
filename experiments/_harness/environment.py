"""Where, when and how a run ran: the record at the head of every results file.

No machine's paths: the command is written as run from the checkout's root
(`python experiments/<script>.py ...`), whichever interpreter and directory ran it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence

from _harness import ROOT

#: The instruction sets a CPU's record names: its 16-bit vector and matrix support.
CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


def now() -> str:
    """This moment to the second, e.g. '2026-05-01T12:00:00'."""
    return datetime.datetime.now().isoformat(timespec="seconds")


def today() -> str:
    """Today's date, e.g. '2026-05-01'."""
    return datetime.date.today().isoformat()


def command(argv: Sequence[str] | None = None) -> str:
    """This run's command line, `python experiments/<script>.py <its arguments>`."""
    argv = sys.argv if argv is None else argv
    return " ".join([f"python experiments/{os.path.basename(argv[0])}", *argv[1:]])


def _cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo ({} where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            block = f.read().split("\n\n")[0]
    except OSError:
        return {}
    info = dict(ln.split(":", 1) for ln in block.splitlines() if ":" in ln)
    return {k.strip(): v.strip() for k, v in info.items()}


def cpu_flags(wanted: Sequence[str] = CPU_FLAGS) -> list[str]:
    """Those of `wanted` that this CPU's flags list, in `wanted`'s order."""
    have = _cpuinfo().get("flags", "").split()
    return [f for f in wanted if f in have]


def cpu_description() -> str:
    """Model name, family/model and the 16-bit instruction sets of this CPU."""
    info = _cpuinfo()
    if not info:
        return platform.processor() or platform.machine()
    return (
        f"{info.get('model name', platform.machine())} (family {info.get('cpu family', '?')} "
        f"model {info.get('model', '?')}; {', '.join(cpu_flags()) or 'no 16-bit vector ISA'})"
    )


def cpu_cores() -> str:
    """'<cpu_description()>, <n> cores'."""
    return f"{cpu_description()}, {os.cpu_count()} cores"


def device_description() -> str:
    """The accelerator's kind (e.g. 'NVIDIA H200'), or this CPU's description without one."""
    import jax  # here: the accuracy scripts describe their machine without importing jax

    device = jax.devices()[0]
    return cpu_description() if device.platform == "cpu" else device.device_kind


def machine_name() -> str:
    """A file-name-safe name of the accelerator (or CPU) and its count, e.g. 'cpu-amd-epyc-2c'."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        label, count = cpu_description().split(" (")[0], os.cpu_count()
        kind = f"cpu-{label}-{count}c"
    else:
        kind = f"{device.device_kind}-x{jax.device_count()}"
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def xla_flags() -> str:
    """'XLA_FLAGS=<the environment's, quoted>'."""
    return f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"


def loadavg() -> float:
    """The 1-minute load average (the machines are shared: it says what ran beside)."""
    return os.getloadavg()[0]


def load_span(start: float) -> str:
    """'loadavg at start 0.52, at end 1.10', `start` taken by `loadavg()` when the run began."""
    return f"loadavg at start {start:.2f}, at end {loadavg():.2f}"


def versions(
    *packages: str, python_first: bool = False, missing: str | None = "(not installed)"
) -> str:
    """'jax 0.10.2, flax 0.12.0, Python 3.11.7' for the installed `packages`, read without
    importing them; a missing one as '<name> <missing>', or left out where `missing` is None."""
    parts = []
    for name in packages:
        try:
            parts.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            if missing is not None:
                parts.append(f"{name} {missing}")
    python = f"Python {platform.python_version()}"
    return ", ".join([python, *parts] if python_first else [*parts, python])


def revision() -> str:
    """The checkout's commit, and whether jamp/ or configs/ differ from it (the code that ran)."""

    def git(*args):
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--", "jamp", "configs")
    return commit + (" with local changes in jamp/ or configs/" if dirty else "")


def environment(
    command: str,
    machine: str,
    versions: str | None = None,
    *,
    took: str = "",
    commit: bool = False,
) -> list[str]:
    """The head of a results file: '- date:', '- command:' (with what the run took, e.g. '3.1
    min'), ('- jamp: commit ...',) '- machine:' and ('- versions:') lines; a script adds its own
    after them."""
    lines = [f"- date: {now()}", f"- command: `{command}`" + (f" ({took})" if took else "")]
    if commit:
        lines.append(f"- jamp: commit {revision()}")
    lines.append(f"- machine: {machine}")
    if versions:
        lines.append(f"- versions: {versions}")
    return lines


def benchmark_environment(
    load0: float,
    *,
    devices: str = "",
    note: str = "",
    packages: Sequence[str] = ("jax", "jaxlib", "flax", "optax"),
) -> list[str]:
    """`environment` for a benchmark timed on this machine: its CPU, JAX's backend (`devices`
    after it, e.g. ', 8 simulated devices'), XLA_FLAGS, the load average from `load0` (taken by
    `loadavg()` at the start) to now, and `note`; `packages`' versions."""
    import jax

    machine = (
        f"{cpu_cores()}, backend {jax.default_backend()}{devices}; {xla_flags()}; "
        f"{load_span(load0)}{note}"
    )
    return environment(command(), machine, versions(*packages))


#: The packages a compile-only (GPU-program) run records, where installed.
COMPILE_PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "flax", "optax", "nvidia-cudnn-cu12")


def run_record(command: str, seconds: float) -> dict:
    """When, where and how one compile-only part ran (kept in the JSON beside the part's rows)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{cpu_description()} with no GPU",
        "versions": versions(*COMPILE_PACKAGES, missing=None),
        "command": command,
        "minutes": round(seconds / 60),
    }


def device_record() -> dict:
    """The device a timed row ran on, for its JSON: kind, backend, jax, XLA_FLAGS."""
    import jax

    device = jax.devices()[0]
    return {
        "device": getattr(device, "device_kind", str(device)),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
