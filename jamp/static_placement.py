"""Static placement: the modules kept in float32 from a run's first step, as `jamp.wrap` overrides.

`placement_overrides` reads module path patterns and the forms "first:N" / "last:N" (the first /
last N of the model's repeated `blocks`), like Megatron's `--first-last-layers-bf16` but for any
model: the training program's `keep_in_float32`. Adaptive precision (`jamp.adaptive`, which
re-exports both functions) moves modules while a run trains instead.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Optional, Sequence

_BLOCK = re.compile(r"^(.*?)_?(\d+)$")


def blocks(top_level: Sequence[str]) -> list[str]:
    """The model's repeated blocks among its top-level module paths, in call order.

    The blocks are the largest family of numbered modules sharing a name (`DecoderBlock_0` ...
    `DecoderBlock_11`, or NNX's `blocks/0` ...); when no family is larger than the others, every
    top-level module counts (a small CNN: `Conv_0`, `Conv_1`, `Dense_0`, `Dense_1`).
    """
    families: dict[str, list[str]] = {}
    for path in top_level:
        match = _BLOCK.match(path.replace("/", "_"))
        if match:
            families.setdefault(match.group(1), []).append(path)
    sizes = sorted((len(v) for v in families.values()), reverse=True)
    if sizes and sizes[0] >= 2 and (len(sizes) == 1 or sizes[0] > sizes[1]):
        return max(families.values(), key=len)
    return list(top_level)


def placement_overrides(
    patterns: Sequence[str], top_level: Sequence[str], paths: Optional[Sequence[str]] = None
) -> dict[str, str]:
    """Static placement: `{path pattern: "float32"}` overrides for `jamp.wrap`.

    Args:
      patterns: module path patterns (fnmatch, as `jamp.wrap` overrides take), plus the forms
        "first:N" and "last:N": the first / last N of the model's repeated blocks (`blocks`),
        like Megatron's `--first-last-layers-bf16` but for any model.
      top_level: the model's top-level module paths in call order.
      paths: every module path of the model; given, a pattern that matches none of them is an
        error (a misspelt path would otherwise keep nothing in float32, silently).

    Raises:
      ValueError: a malformed "first:"/"last:" form, N larger than the number of blocks, or a
        pattern matching no module.
    """
    found = blocks(top_level)
    out: dict[str, str] = {}
    for pattern in patterns:
        head, sep, count = pattern.partition(":")
        if sep and head in ("first", "last"):
            if not count.isdigit() or not 1 <= int(count) <= len(found):
                raise ValueError(
                    f"{pattern!r}: N must be an integer from 1 to {len(found)}, the number of "
                    f"blocks ({', '.join(found[:3])}{' ...' if len(found) > 3 else ''})"
                )
            chosen = found[: int(count)] if head == "first" else found[-int(count) :]
            out.update({path: "float32" for path in chosen})
        elif sep:
            raise ValueError(f"{pattern!r}: accepted are module path patterns and first:N / last:N")
        else:
            if paths is not None and not any(fnmatch.fnmatchcase(p, pattern) for p in paths):
                shown = [p for p in paths if p][:8]
                more = " ..." if len([p for p in paths if p]) > 8 else ""
                raise ValueError(
                    f"{pattern!r} matches no module of the model; its modules are "
                    f"{', '.join(shown)}{more} (patterns are fnmatch-style: 'blocks/*/attention')"
                )
            out[pattern] = "float32"
    return out
