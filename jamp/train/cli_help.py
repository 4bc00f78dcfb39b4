"""What `python -m jamp.train --help` prints, and the suggestions of its one-line errors.

absl's own `--help` lists absl's flags and none of the recipe's fields; this lists the recipe's
fields (the policy first) with their values, the policy names, the recipes and an example.
"""

from __future__ import annotations

import difflib
import re
import runpy
from typing import Any, Iterable, Optional

HELP_FLAGS = ("--help", "-h", "--helpshort", "-help")
_FIRST = ("policy", "model", "dataset", "batch_size", "num_train_steps", "loss_scale")


def recipe_config(path: str) -> Any:
    """The ConfigDict of a recipe file ("path" or "path:variant")."""
    spec, _, variant = path.partition(":")
    return runpy.run_path(spec)["get_config"](variant)


def _value(v) -> str:
    text = repr(v.to_dict() if hasattr(v, "to_dict") else v)
    return text if len(text) <= 60 else text[:57] + "..."


def help_text(recipe_path: str, recipes: Iterable[str], presets: Iterable[str]) -> str:
    """The program's help: usage, the recipe's fields with their values, policies, recipes."""
    config = recipe_config(recipe_path)
    keys = [k for k in _FIRST if k in config] + sorted(k for k in config if k not in _FIRST)
    width = max(len(k) for k in keys)
    fields = "\n".join(f"  --config.{k:<{width}} = {_value(config[k])}" for k in keys)
    return f"""usage: python -m jamp.train [--config=<recipe>[:smoke]] [--config.<field>=<value> ...]
                            [--workdir=<dir>] [--compile_for=<gpu>]

Trains the recipe under a precision policy; rerun with the same --workdir to resume.

Policies (--config.policy): {", ".join(presets)}, auto (the fastest this device runs natively);
  or jmp's grammar, e.g. 'p=f32,c=bf16,o=f32', 'mixed_bfloat16,params=bf16' (docs/guides/policies.md).
Recipes (--config): {", ".join(recipes)}; ':smoke' is a tiny run of one.

Fields of {recipe_path.rsplit("/", 1)[-1].partition(":")[0]} (--config.<field>=<value>):
{fields}

Other flags: --workdir (checkpoints and metrics), --compile_for=h200x8 (the step compiled for
GPUs, no GPU needed), --coordinator_address / --num_processes / --process_id (multi-process).

Example:
  python -m jamp.train --config=lm_pydoc:smoke --config.policy=mixed_bfloat16 --workdir=/tmp/lm
"""


def did_you_mean(name: str, candidates: Iterable[str]) -> Optional[str]:
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.7)
    return found[0] if found else None


def field_error(e: BaseException) -> str:
    """ml_collections' "no such field" (a KeyError or AttributeError whose message holds the
    field and a suggestion) as one line."""
    while e.args and isinstance(e.args[0], BaseException):  # an AttributeError(KeyError(...))
        e = e.args[0]
    text = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
    first = text.strip().splitlines()[0].strip() if text.strip() else type(e).__name__
    name = re.findall(r"""['"]([^'"]+)['"]""", first)
    field = name[0] if name else first.strip("\"' ")
    suggested = re.search(r'Did you mean "([^"]+)"', text)
    hint = f" (did you mean {suggested.group(1)}?)" if suggested else ""
    return f"{field}{hint}"
