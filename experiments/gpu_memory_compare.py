"""Memory on the H200 program before and after a change: the gpu_compile experiment's rows and the
GPT-2 step variants, side by side, with what the temporaries hold by dtype at their peak.

Everything is XLA's plan for the target (per device, compiled on a CPU host), not a measured
peak; predicted step times are `jamp.compile_for`'s model, not measurements.

    # the variants' programs, in whichever tree this runs from (a worktree of the old commit
    # for "before"):
    python experiments/gpu_memory_compare.py --dump-variants /tmp/after.jsonl
    # the table: the experiment's JSON at an earlier commit against the checkout's
    python experiments/gpu_memory_compare.py --before-commit 7bc3bdd \\
        --variants-before /tmp/before.jsonl --variants-after /tmp/after.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness.tables import GIB, gib, gib_parts  # noqa: E402
from gpu_compile_report import largest_text  # noqa: E402  (reads the JSON only)

RESULT = "results/gpu_compile_h200_fused_attention.json"
VARIANTS = (
    "lm_jamp_bf16",
    "lm_jamp_bf16_losses",
    "lm_jamp_bf16_chunked",
    "lm_hand_bf16",
    "hf_jamp_bf16",
    "llama_jamp_bf16",
)


def dump_variants(path: str) -> None:
    sys.path.insert(0, str(HERE.parent))
    import gpt2_variants

    import jamp

    with open(path, "w") as out:
        for name in VARIANTS:
            if name not in gpt2_variants.VARIANTS:
                continue  # not in this tree yet
            built = gpt2_variants.build(name, batch=8)
            report = jamp.compile_for(built.step, *built.abstract_args, target="h200")
            m = report.memory
            row = {
                "name": name,
                "peak": m.peak,
                "temp": m.temporaries,
                "by_dtype": m.temporaries_by_dtype,
                "predicted_ms": round(report.estimate.seconds * 1e3, 2),
                "kernels": report.estimate.kernels,
            }
            out.write(json.dumps(row) + "\n")
            print(row, flush=True)


def _rows_table(before: dict, after: dict, part: str) -> list[str]:
    old = {(r["label"], r["batch"]): r for r in before.get(part, [])}
    lines = [
        "| step | batch | temporaries GiB | peak GiB | temporaries at their peak, by dtype (GiB) |"
        " largest batch |",
        "|---|---|---|---|---|---|",
    ]
    for r in after.get(part, []):
        o = old.get((r["label"], r["batch"]))
        if o is None:
            continue

        # where a search stopped at its compile budget, the batch found is a lower bound
        big = f"{largest_text(o) or '-'} -> {largest_text(r)}" if largest_text(r) else ""
        if o == r:  # a row this run left as it was (e.g. a part rerun for one policy only)
            lines.append(f"| {r['label']} | {r['batch']} | not rerun: {gib(r['temp'])} | | | |")
            continue
        was, now = (gib_parts(x["by_dtype"], GIB / 100, skip=("free",), empty="") for x in (o, r))
        lines.append(
            f"| {r['label']} | {r['batch']} | {gib(o['temp'])} -> {gib(r['temp'])} | "
            f"{gib(o['peak'])} -> {gib(r['peak'])} | {was} -> {now} | {big} |"
        )
    return lines


def _variants_table(before: list[dict], after: list[dict]) -> list[str]:
    old = {r["name"]: r for r in before}
    lines = [
        "| GPT-2-small step, batch 8 | peak GiB | float32 at the peak GiB | kernels |"
        " predicted ms |",
        "|---|---|---|---|---|",
    ]
    for r in after:
        o = old.get(r["name"])

        def pair(key, fmt, o=o, r=r):
            now = fmt(r[key])
            return f"{fmt(o[key])} -> {now}" if o else f"(new) {now}"

        def f32(by):
            return gib(by["f32"])

        def ms(v):
            return f"{v:.2f}"

        lines.append(
            f"| {r['name']} | {pair('peak', gib)} | {pair('by_dtype', f32)} | "
            f"{pair('kernels', str)} | {pair('predicted_ms', ms)} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-variants", help="compile the variants here, write JSON lines")
    parser.add_argument("--before-commit", help="the commit whose experiment JSON is 'before'")
    parser.add_argument("--variants-before", help="JSON lines of --dump-variants, before")
    parser.add_argument("--variants-after", help="JSON lines of --dump-variants, after")
    parser.add_argument("--out", default=str(HERE / "results" / "gpu_memory_h200.md"))
    args = parser.parse_args(argv)
    if args.dump_variants:
        dump_variants(args.dump_variants)
        return 0
    shown = subprocess.run(
        ["git", "show", f"{args.before_commit}:experiments/{RESULT}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=HERE,
    )
    before, after = json.loads(shown.stdout), json.loads((HERE / RESULT).read_text())
    text = [
        f"# Memory on the H200 program: {args.before_commit} -> this checkout",
        "",
        "XLA's buffer assignment for one H200 (per device), compiled on a CPU host: a plan, not "
        "a measured peak. Predicted times are jamp.compile_for's model, not measurements. "
        f"Experiment rows from `experiments/{RESULT}` (at {args.before_commit} and now; each "
        "part's run record there names its machine and command).",
        "",
    ]
    if args.variants_before and args.variants_after:

        def load(path):
            return [json.loads(line) for line in open(path) if line.strip()]

        text += [
            "## The GPT-2-small step's variants (experiments/gpt2_variants.py)",
            "",
            "`lm_jamp_bf16`: jamp's TransformerLM wrapped mixed_bfloat16 with optax's loss on "
            "float32 logits, as users write it; `_losses`: jamp.losses' cross-entropy; "
            "`_chunked`: jamp.losses.fused_linear_cross_entropy; `lm_hand_bf16`: the network "
            "written by hand in bf16 with cuDNN attention; `hf_jamp_bf16`: Hugging Face's Flax "
            "GPT-2 wrapped; `llama_jamp_bf16`: LlamaLM 12 x 768, 4 kv heads of 12.",
            "",
            *_variants_table(load(args.variants_before), load(args.variants_after)),
            "",
        ]
    for part, title in (
        ("gpt2", "GPT-2 small through the training program (one H200)"),
        ("decoders", "The Llama-style decoders of configs/llama.py (8 H200s)"),
        ("models", "NNX models, ours and Tunix's Llama 3"),
    ):
        text += [f"## {title}", "", *_rows_table(before, after, part), ""]
    pathlib.Path(args.out).write_text("\n".join(text))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
