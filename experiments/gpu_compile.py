"""What the H200's compiler makes of jamp's steps, on a machine without a GPU (jamp.compile_for).

Two questions, answered from the real GPU programs (XLA's buffer plan per device, not a measured
peak; no speed):

1. GPT-2-small shape (12 x 768, 12 heads, seq 1024, vocab 50304, AdamW) on one H200 at batch 8,
   16 and 32: jamp's float32 step, mixed_bfloat16 with float32 and with 16-bit activations,
   mixed_float16 (dynamic loss scale), mixed_fp8, and the same network written by hand in bf16
   Flax with Flax's attention and with `jax.nn.dot_product_attention(implementation="cudnn")`:
   temporaries, peak, what the temporaries hold by dtype, and the largest batch that fits.
2. The Llama-style decoders of configs/llama.py (1.5B, 7B) on 8 H200s under pmap, fsdp=8 and
   data=2,fsdp=4 with mixed_bfloat16 and mixed_fp8: memory per device, bytes on the wire by
   dtype, the largest global batch that fits.
3. NNX models, ours and one nobody here wrote (Tunix's Llama 3), wrapped under mixed_bfloat16
   against each model's own bf16 build (experiments/gpu_compile_models.py).
5. The train step's own cost (`--part step_cost`): for jamp's TransformerLM at GPT-2-small size,
   Hugging Face's Flax GPT-2 and the Llama-style decoder (experiments/gpt2_variants.py), the
   kernels of jamp's step against a plain value_and_grad + optax step of the same wrapped model,
   the gradients XLA writes out because the finite check reads them beside the update, and the
   step time jamp.inspect.timing predicts (a model, not a measurement); with `--before DIR`,
   the same of the programs in DIR (<variant>.hlo from gpu_estimate.py --dump at an earlier
   commit). And where the predicted time of the jamp bf16 step goes, by kind of work.
4. Past float32 master weights: the deepest decoder of Llama-2-70B's widths that fits on 8 H200s
   under fsdp=8 (seq 512, one sequence per device, layers rematerialized keeping their matmuls'
   outputs) with fp32 master weights and Adam, with bf16 params and bf16 Adam moments, with bf16
   params and 8-bit moments (`--part master_weights`).

    python experiments/gpu_compile.py                   # all (hours on a 2-core CPU)
    python experiments/gpu_compile.py --part gpt2       # question 1 only (each part is added to
                                                        # the JSON at --out, the rest kept)
    python experiments/gpu_compile.py --quick           # tiny shapes, for the tests

Every step is compiled without XLA's rematerialization pass (jamp.train.plan.NO_REMAT): near
the memory's size XLA recomputes activations to make a step fit, and the peak would stop
saying what the batch needs. Needs JAX's CUDA plugin (pip install 'jamp-jax[gpu-compile]'); writes
experiments/results/gpu_compile_h200.md and .png (quick: under --out).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import gpu_compile_models  # noqa: E402
from _harness import RESULTS  # noqa: E402
from _harness.environment import run_record  # noqa: E402
from peers_flax import HandLM, cudnn_attention  # noqa: E402

import jamp  # noqa: E402
from jamp.target import compile_for, get_target, memory_fraction  # noqa: E402
from jamp.train import plan  # noqa: E402
from jamp.train.cli import RECIPES_DIR  # noqa: E402

GPT2 = dict(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072, max_len=1024)
GPT2_QUICK = dict(num_layers=2, d_model=64, num_heads=4, mlp_dim=128, max_len=64)
# (label, policy, activations); "hand" rows are the hand-written Flax network
JAMP_ROWS = [
    ("jamp float32", "float32", "auto"),
    ("jamp mixed_bfloat16, activations float32", "mixed_bfloat16", "float32"),
    ("jamp mixed_bfloat16 (auto: 16-bit activations)", "mixed_bfloat16", "auto"),
    ("jamp mixed_float16, dynamic loss scale", "mixed_float16", "auto"),
    ("jamp mixed_fp8 (delayed)", "mixed_fp8", "auto"),
]
HAND_ROWS = [
    ("hand-written bf16 Flax, Flax attention", "flax"),
    ("hand-written bf16 Flax, cuDNN attention", "cudnn"),
]


def _recipe(name: str, overrides: dict, target: str):
    config = _load(name)
    for key, value in overrides.items():
        node, *path = key.split(".")
        if path:
            config[node][path[0]] = value
        else:
            config[key] = value
    return plan.parse(config, target)


def _load(name):
    import runpy

    spec, _, variant = name.partition(":")
    return runpy.run_path(str(RECIPES_DIR / f"{spec}.py"))["get_config"](variant)


def gpt2_recipe(policy, activations, quick, target="h200"):
    shape = GPT2_QUICK if quick else GPT2
    overrides = {f"model_config.{k}": v for k, v in shape.items()}
    overrides.update(
        policy=policy,
        activations=activations,
        dataset="synthetic_tokens",
        vocab_size=512 if quick else 50304,
        seq_len=shape["max_len"],
        optimizer="adamw",
        parallelism="pmap",
        batch_size=8,
        accumulation_steps=1,
    )
    return _recipe("lm_pydoc", overrides, target)


def hand_report(attention: str, batch: int, quick: bool, options=None, target="h200"):
    """The hand-written bf16 network's train step (the same loss, AdamW and step as jamp's)."""
    shape = GPT2_QUICK if quick else GPT2
    vocab = 512 if quick else 50304
    attention_fn = cudnn_attention if attention == "cudnn" else None
    model = HandLM(vocab_size=vocab, dtype=jnp.bfloat16, attention_fn=attention_fn, **shape)
    length = shape["max_len"]
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
    )
    tx = optax.adamw(1e-3)

    def loss_fn(p, model_state, batch_, rng):
        tokens = batch_["tokens"]
        logits = model.apply({"params": p}, tokens[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return loss, (model_state, {})

    state = jax.eval_shape(lambda: jamp.TrainState.create(params, tx))
    step = jax.jit(jamp.make_train_step(loss_fn, tx), donate_argnums=(0,))
    tokens = {"tokens": jax.ShapeDtypeStruct((batch, length + 1), jnp.int32)}
    key = jax.eval_shape(lambda: jax.random.key(0))
    return compile_for(step, state, tokens, key, target=target, compiler_options=options)


def _row(label, report, batch):
    m = report.memory
    fp32 = sum(n for *_, n in report.fp32_gemms())
    return {
        "label": label,
        "batch": batch,
        "temp": m.temporaries,
        "peak": m.peak,
        "by_dtype": m.temporaries_by_dtype,
        "fused_attention": sum(a.fused for a in report.attention),
        "unfused_attention": sum(not a.fused for a in report.attention),
        "gemms": {f"{g.operands} {g.kind}": g.count for g in report.gemm_groups()},
        "fp32_gemms": fp32,
        "activations": list(report.activations),
        "compile_s": round(report.compile_seconds, 1),
        "usable": report.usable_bytes(),
    }


def gpt2_part(quick: bool, log, only=None) -> list[dict]:
    batches = (8, 16) if quick else (8, 16, 32)
    rows = []
    for label, policy, activations in JAMP_ROWS:
        if only and policy != only:
            continue
        recipe = gpt2_recipe(policy, activations, quick)
        reports = {b: plan.compile_at(recipe, b, plan.NO_REMAT) for b in batches}
        rows += [_row(label, r, b) for b, r in reports.items()]
        rows[-1]["largest"] = _largest(
            lambda b, r=recipe: plan.compile_at(r, b, plan.NO_REMAT).memory.peak, reports, quick
        )
        log(rows[-len(batches) :])
    for label, attention in () if only else HAND_ROWS:
        reports = {b: hand_report(attention, b, quick, plan.NO_REMAT) for b in batches}
        rows += [_row(label, r, b) for b, r in reports.items()]
        rows[-1]["largest"] = _largest(
            lambda b, a=attention: hand_report(a, b, quick, plan.NO_REMAT).memory.peak,
            reports,
            quick,
        )
        log(rows[-len(batches) :])
    return rows


def _largest(peak_at, reports, quick):
    known = {b: r.memory.peak for b, r in reports.items()}
    usable = next(iter(reports.values())).usable_bytes()
    found = plan.search_batch(
        peak_at, min(known), 1, usable, max_compiles=0 if quick else 3, known=known
    )
    return _found(found)


def _found(found) -> dict:
    """A batch search's outcome (plan.search_batch), as the JSON keeps it."""
    return {
        "batch": found.batch,
        "above": found.above,
        "complete": found.complete,
        "peaks": {str(b): p for b, p in sorted(found.peaks.items())},
    }


def decoder_part(quick: bool, log, only=None) -> list[dict]:
    rows = []
    sizes = ("smoke",) if quick else ("", "7b")
    layouts = [
        ("pmap", "pmap", ""),
        ("fsdp=8", "sharded", "fsdp=8"),
        ("data=2,fsdp=4", "sharded", "data=2,fsdp=4"),
    ]
    policies = ("mixed_bfloat16",) if quick else ("mixed_bfloat16", "mixed_fp8")
    policies = tuple(p for p in policies if not only or p == only)
    for size in sizes:
        for policy in policies:
            for layout, parallelism, mesh in layouts:
                overrides = dict(policy=policy, parallelism=parallelism)
                if mesh:
                    overrides["mesh"] = mesh
                recipe = _recipe(f"llama:{size}", overrides, "h200x8")
                batch = recipe.run.batch_size
                report = plan.compile_at(recipe, batch, plan.NO_REMAT)
                row = _row(f"llama {size or '1b5'} {policy} {layout}", report, batch)
                row["arguments"] = report.memory.arguments
                row["params"] = plan.param_count(plan.abstract_state(recipe)[2])
                row["wire"] = [
                    {
                        "kind": c.kind,
                        "dtype": c.dtype,
                        "axes": list(c.axes),
                        "count": c.count,
                        "bytes": c.nbytes,
                    }
                    for c in report.collectives
                ]
                # 7B under pmap: 75 GiB of state and its activations, far over the pool at the
                # smallest batch (8): not searched
                budget = 0 if quick or (layout == "pmap" and size == "7b") else 2
                found = plan.search_batch(
                    lambda b, r=recipe: plan.compile_at(r, b, plan.NO_REMAT).memory.peak,
                    batch,
                    recipe.batch_unit,
                    report.usable_bytes(),
                    max_compiles=budget,
                    known={batch: report.memory.peak},
                )
                row["largest"] = _found(found)
                rows.append(row)
                log([row])
    return rows


def models_part(quick: bool, log, only=None) -> list[dict]:
    if only:  # its variants are not policies
        return []
    batch = 8
    rows = []
    for name in gpu_compile_models.MODELS:
        if "Tunix" in name and gpu_compile_models.tunix_llama3() is None:
            print(f"{name}: google-tunix is not installed, left out", flush=True)
            continue
        for variant in gpu_compile_models.VARIANTS:
            report = gpu_compile_models.report(name, variant, batch, quick, plan.NO_REMAT)
            row = _row(f"{name}: {variant}", report, batch)
            # NNX modules set no name scopes, so the report's attention sites (by module path)
            # lump a model's layers together: count cuDNN's forward calls instead, one per layer
            row["fused_attention"] = sum(a.forward for a in report.attention if a.fused)
            rows.append(row)
            log(rows[-1:])
    return rows


# (label, policy, optimizer_state): what the params and Adam's moments are stored in
MASTER_VARIANTS = [
    ("fp32 master + fp32 Adam", "mixed_bfloat16", "float32"),
    ("bf16 params (stochastic rounding) + bf16 Adam", "mixed_bfloat16,params=bf16", "bfloat16"),
    ("bf16 params (stochastic rounding) + 8-bit Adam", "mixed_bfloat16,params=bf16", "int8"),
]
# Llama-2-70B's widths, a short sequence and one sequence per device: the state, not the
# activations, decides how deep a model fits (the regime where master weights bound it). Each
# layer is rematerialized keeping its matmuls' outputs (LlamaLM remat="dots"): without it XLA
# keeps every weight FSDP gathered for the forward pass until the backward, a whole model in
# bf16 on every device, and that, not the state, bounds the depth.
MASTER_SHAPE = {"seq_len": 512, "batch_size": 8, "mesh": "fsdp=8", "model_config.remat": "dots"}
# The compiler's same-shape multi-output fusion merges every layer's optimizer update into a few
# kernels that grow with the depth (compiles 1.5x longer at 8 layers); off here, where only the
# memory plan is read (the peak was the same with and without it).
MASTER_OPTIONS = {
    **plan.NO_REMAT,
    "xla_gpu_experimental_enable_same_shape_multi_output_fusion": False,
}


def master_weights_part(
    quick: bool, log, only=None, max_compiles: int = 6, variant: str = "", first: int = 0
) -> list[dict]:
    """The deepest Llama-70B-wide decoder whose step fits on 8 H200s under fsdp=8, per choice of
    params and optimizer-state storage: layers searched by compiling (two shallow compiles
    draw the line the peak follows with depth, plan.search_batch takes it from there, to
    within 1/32 of the depth or `max_compiles` more compiles; `first`: a depth to compile
    before the search)."""
    if only:  # its variants are not policies
        return []
    rows = []
    size, shallow = ("smoke", (2,)) if quick else ("70b", (2, 6))
    for label, policy, state in MASTER_VARIANTS:
        if variant not in label:
            continue
        base = dict(policy=policy, optimizer_state=state, parallelism="sharded", **MASTER_SHAPE)
        reports, recipes = {}, {}

        def peak_at(layers, base=base, reports=reports, recipes=recipes, label=label):
            recipe = _recipe(f"llama:{size}", {**base, "model_config.num_layers": layers}, "h200x8")
            reports[layers] = plan.compile_at(recipe, recipe.run.batch_size, MASTER_OPTIONS)
            recipes[layers] = recipe
            r = reports[layers]
            print(
                f"  {label}: {layers} layers, peak {r.memory.peak / 2**30:.2f} GiB "
                f"(usable {r.usable_bytes() / 2**30:.2f}), compile {r.compile_seconds:.0f} s",
                flush=True,
            )
            return r.memory.peak

        known = {layers: peak_at(layers) for layers in (*shallow, first) if layers}
        found = plan.search_batch(
            peak_at,
            shallow[-1],
            1,
            reports[shallow[-1]].usable_bytes(),
            max_compiles=0 if quick else max_compiles,
            known=known,
        )
        layers = found.batch or shallow[0]
        report, recipe = reports[layers], recipes[layers]
        row = _row(label, report, recipe.run.batch_size)
        abstract = plan.abstract_state(recipe)[2]
        row.update(
            layers=layers,
            above=found.above,
            complete=found.complete,
            fits=found.batch is not None,
            params=plan.param_count(abstract),
            bytes_per_param=jamp.lowbit.bytes_per_param(abstract),
            arguments=report.memory.arguments,
            peaks={str(k): v for k, v in sorted(found.peaks.items())},
            compiles=len(reports),
            seconds=round(sum(r.compile_seconds for r in reports.values()), 1),
        )
        rows.append(row)
        log([row])
    return rows


STEP_COST_ROWS = (
    ("lm", "jamp's TransformerLM"),
    ("hf", "Hugging Face Flax GPT-2"),
    ("llama", "LlamaLM (12 x 768, 4 kv heads)"),
)


def _category(kernel) -> str:
    """Where a kernel's time goes, by the kind of work its op name says it does."""
    from jamp.grad_stats import SCOPE
    from jamp.inspect._paths import op_name_path

    o = kernel.op_name
    if kernel.kind == "gemm":
        head = any(h in o for h in ("Embed_0.attend", "lm_head", "wte"))
        return "GEMMs: output head (logits)" if head else "GEMMs: layers"
    if kernel.kind == "attention":
        return "attention (cuDNN)"
    if f"/{SCOPE}/" in o:
        return "step: gradient norm and finite check"
    path, backward = op_name_path(o) if o else ("", False)
    if not path:
        if "jvp(" in o:
            return "loss over the vocabulary (forward and backward)"
        return "optimizer update, skip select, counters" if o else "unnamed (XLA's copies)"
    if "norm" in path.lower() or "ln_" in path:
        return "layer norms"
    if "convert_element_type" in o and not backward:
        return "casts (params and activations to 16 bits)"
    return f"other elementwise in the model ({'backward' if backward else 'forward'})"


def _cost_row(label, variant, program_text, batch=8, compile_s=0.0, memory=None):
    from jamp import hlo
    from jamp.grad_stats import SCOPE
    from jamp.hlo.kernels import ends_in_reduction, kernels, shared_results
    from jamp.inspect import timing
    from jamp.target import GPUS

    program = hlo.parse(program_text)
    est = timing.estimate(program, GPUS["h200"])
    found = kernels(program)
    shared = shared_results(program, SCOPE)
    categories: dict[str, list] = {}
    for k in found:
        entry = categories.setdefault(_category(k), [0, 0.0])
        entry[0] += k.count
        entry[1] += timing.kernel_seconds(k, GPUS["h200"])[0] * k.count
    return {
        "label": label,
        "variant": variant,
        "batch": batch,
        "temp": memory.temporaries if memory else 0,
        "peak": memory.peak if memory else 0,
        "compile_s": round(compile_s, 1),
        "kernels": est.kernels,
        "shared": len(shared),
        "shared_reducing": sum(ends_in_reduction(program, name) for name in shared),
        "stats_kernels": sum(k.count for k in found if f"/{SCOPE}/" in k.op_name),
        "predicted_ms": est.seconds * 1e3,
        "categories": {k: {"kernels": n, "ms": t * 1e3} for k, (n, t) in categories.items()},
    }


def step_cost_part(quick: bool, log, only=None, before=None) -> list[dict]:
    import gpt2_variants

    rows = []
    variants = [(f, f"{f}_{k}") for f, _ in STEP_COST_ROWS for k in ("plain_bf16", "jamp_bf16")]
    variants += [("lm", "lm_jamp_bf16_losses"), ("lm", "lm_hand_bf16")]
    names = dict(STEP_COST_ROWS)
    for family, variant in variants:
        if family == "hf" and importlib.util.find_spec("transformers") is None:
            print(f"{variant}: skipped (transformers < 5 is not installed)", flush=True)
            continue
        built = gpt2_variants.build(variant, batch=8, quick=quick)
        report = compile_for(built.step, *built.abstract_args, target="h200")
        row = _cost_row(
            f"{names[family]}: {variant.split('_', 1)[1]}",
            variant,
            report.hlo_text,
            compile_s=report.compile_seconds,
            memory=report.memory,
        )
        rows.append(row)
        log([row])
        old = pathlib.Path(before) / f"{variant}.hlo" if before else None
        if old is not None and old.exists():
            rows.append(
                {**_cost_row(row["label"] + " (before)", variant, old.read_text()), "before": True}
            )
    return rows


PARTS = {
    "gpt2": gpt2_part,
    "decoders": decoder_part,
    "models": models_part,
    "master_weights": master_weights_part,
    "step_cost": step_cost_part,
}


def _replaced(rows: list[dict], new: list[dict]) -> list[dict]:
    """`rows` with those of the same label and batch as a row of `new` replaced by it, in place;
    the rest of `new` appended."""
    fresh = {(r["label"], r["batch"]): r for r in new}
    out = [fresh.pop((r["label"], r["batch"]), r) for r in rows]
    return out + list(fresh.values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--max-compiles",
        type=int,
        default=6,
        help="master_weights: compiles per variant after the two shallow ones (the deep ones "
        "take 5-25 min each on a 2-core CPU)",
    )
    parser.add_argument(
        "--first",
        type=int,
        default=0,
        help="master_weights: a depth to compile before the search (the line through two "
        "shallow compiles underestimates the peak at depth: 1.11x its slope for fp32 master)",
    )
    parser.add_argument(
        "--variant",
        default="",
        help="master_weights: only the variants whose label holds this (e.g. '8-bit'); run "
        "apart, write each to its own --out",
    )
    parser.add_argument(
        "--before",
        default="",
        help="step_cost: a directory of <variant>.hlo (gpu_estimate.py --dump at an earlier "
        "commit) to report beside this tree's programs",
    )
    parser.add_argument("--out", default=str(RESULTS / "gpu_compile_h200"))
    parser.add_argument(
        "--policy",
        choices=sorted({policy for _, policy, _ in JAMP_ROWS}),
        help="rerun only this policy's rows of jamp (e.g. mixed_fp8 after an fp8 change), "
        "replacing them in the results and recording the rerun beside the part's own run",
    )
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".json")
    results = json.loads(raw.read_text()) if raw.exists() and not args.quick else {}

    def log(rows):
        for r in rows:
            print(
                f"{r['label']:<52} batch {r['batch']:>3}: temp {r['temp'] / 2**30:7.2f} GiB, "
                f"peak {r['peak'] / 2**30:7.2f} GiB, compile {r['compile_s']} s",
                flush=True,
            )

    from gpu_compile_report import write  # apart: it only reads the JSON

    command = " ".join(["python experiments/gpu_compile.py", *(argv or sys.argv[1:])])
    for part, run in PARTS.items():
        if args.part in (part, "all"):
            started = time.time()
            more = {}
            if part == "step_cost":
                more = {"before": args.before}
            if part == "master_weights":
                more = {
                    "max_compiles": args.max_compiles,
                    "variant": args.variant,
                    "first": args.first,
                }
            rows = run(args.quick, log, args.policy, **more)
            record = run_record(command, time.time() - started)
            if part == "step_cost" and args.before:
                record["note"] = (
                    f"'(before)' rows: the programs in {args.before}, dumped by "
                    "`python experiments/gpu_estimate.py --dump` at an earlier commit"
                )
            if args.policy:
                if not rows:
                    continue
                results[part] = _replaced(results.get(part, []), rows)
                record["rows"] = args.policy
                runs = results.setdefault("runs", {}).setdefault(part, {})
                runs.setdefault("reruns", []).append(record)
            else:
                results[part] = rows
                # each part says when, where and by which command it ran: parts run apart
                results.setdefault("runs", {})[part] = record
            raw.write_text(json.dumps(results, indent=1))
    write(results, out, fraction=memory_fraction(), target=get_target("h200"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
