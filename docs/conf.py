"""Sphinx configuration of jamp's documentation site (built offline: no intersphinx)."""

import os
import re
import sys

sys.path.insert(0, os.path.abspath(".."))  # the checkout's jamp, installed or not

import jamp  # noqa: E402

project = "jamp"
author = "the jamp authors"
copyright = "the jamp authors"  # noqa: A001
release = jamp.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: $-free pages; `` ```{directive} `` fences and (target)= labels; heading anchors so that
# [text](page.md#a-heading) links resolve.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: the docstrings are Google style (Args: / Returns: / Example:).
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"jamp {release}"
html_static_path = []

# jamp's docstrings are written as plain text with Markdown-style `code` spans (and RST's `::`
# literal blocks and doctests). Read a single-backquoted span as code, not as RST's interpreted
# text, and keep RST from reading a bare `*args`, a glob's `*` or `|x|` as markup: the docstrings
# stay as they are, and the build stays free of warnings.
default_role = "code"

_SPAN = re.compile(r"``.+?``|`[^`]+`")


def _plain_line(line: str) -> str:
    bullet = re.match(r"\s*[*-] ", line)  # a list item's bullet stays one
    pos = bullet.end() if bullet else 0
    out = [line[:pos]]
    for match in _SPAN.finditer(line):
        out.append(_escape(line[pos : match.start()]))
        span = match.group(0)
        if not span.startswith("``"):
            span = "`" + span[1:-1].strip() + "`"
        before = line[match.start() - 1] if match.start() else " "
        after = line[match.end()] if match.end() < len(line) else " "
        # RST wants a span's start after, and its end before, whitespace or punctuation.
        if before.isalnum() or before in "_`":
            span = "\\ " + span
        if after.isalnum() or after in "_`":
            span = span + "\\ "
        out.append(span)
        pos = match.end()
    out.append(_escape(line[pos:]))
    return "".join(out)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|")


def _docstring_as_text(app, what, name, obj, options, lines):
    literal_indent = None  # inside a `::` literal block: the indent of the line that opened it
    doctest = False
    for i, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None:
            if not stripped or indent > literal_indent:
                continue
            literal_indent = None
        if doctest:
            if stripped:
                continue
            doctest = False
            continue
        if stripped.startswith(">>>"):
            doctest = True
            continue
        lines[i] = _plain_line(line)
        if stripped.endswith("::"):
            literal_indent = indent
    return lines


def setup(app):
    # Before napoleon (priority 500) turns Args: / Returns: sections into fields.
    app.connect("autodoc-process-docstring", _docstring_as_text, priority=400)
