"""Build the example notebooks from their plain-Python sources, so the two never drift.

Each example is written once, as a script in "percent" format (the format of Jupytext, VS Code and
Spyder): ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose lines are comments
(``# `` is stripped), and ``# %% tags=["parameters"]`` a code cell with tags (papermill's parameter
cell). Lines before the first marker and file-level ``# ruff:`` / ``# noqa`` directives are dropped.

    python examples/build_notebooks.py           # rewrite examples/*.ipynb
    python examples/build_notebooks.py --check   # exit 1 if a committed notebook is out of date

Needs only the standard library and ``nbformat``. Notebooks are written without outputs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

EXAMPLES_DIR = Path(__file__).resolve().parent
SOURCES = ("finetune_centroids.py", "use_adapter.py", "inspect_groups.py")
_MARKER = re.compile(r"^# %%(?P<rest>.*)$")
_DIRECTIVE = re.compile(r"^#\s*(ruff|noqa|type|pragma)\b.*$")
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def parse_cells(text: str) -> list[dict]:
    """Split a percent-format script into ``[{"type": "code"|"markdown", "source": str, "tags": [...]}]``."""
    cells: list[dict] = []
    current: dict | None = None
    for line in text.splitlines():
        m = _MARKER.match(line)
        if m:
            rest = m.group("rest").strip()
            kind = "markdown" if rest.startswith("[markdown]") or rest.startswith("[md]") else "code"
            tags: list[str] = []
            t = re.search(r"tags\s*=\s*(\[.*\])", rest)
            if t:
                tags = json.loads(t.group(1))
            current = {"type": kind, "lines": [], "tags": tags}
            cells.append(current)
        elif current is not None and not _DIRECTIVE.match(line):
            current["lines"].append(line)
    out = []
    for cell in cells:
        lines = cell["lines"]
        if cell["type"] == "markdown":
            bad = [ln for ln in lines if ln.strip() and not ln.startswith("#")]
            if bad:
                raise ValueError(f"markdown cell has a line that is not a comment: {bad[0]!r}")
            lines = [ln[2:] if ln.startswith("# ") else ln[1:] for ln in lines]
        while lines and not lines[0].strip():
            lines = lines[1:]
        while lines and not lines[-1].strip():
            lines = lines[:-1]
        if lines:
            out.append({"type": cell["type"], "source": "\n".join(lines), "tags": cell["tags"]})
    return out


def build_notebook(source: Path) -> nbformat.NotebookNode:
    """The notebook for one percent-format script: no outputs, deterministic cell ids."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    stem = source.stem.replace("_", "-")
    for i, cell in enumerate(parse_cells(source.read_text(encoding="utf-8"))):
        make = nbformat.v4.new_markdown_cell if cell["type"] == "markdown" else nbformat.v4.new_code_cell
        nb_cell = make(cell["source"], id=f"{stem}-{i:02d}")
        if cell["tags"]:
            nb_cell.metadata["tags"] = cell["tags"]
        nb.cells.append(nb_cell)
    nbformat.validate(nb)
    return nb


def notebook_text(source: Path) -> str:
    return nbformat.writes(build_notebook(source)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the notebooks are up to date")
    args = parser.parse_args(argv)
    stale = []
    for name in SOURCES:
        source = EXAMPLES_DIR / name
        target = source.with_suffix(".ipynb")
        text = notebook_text(source)
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(target.name)
        else:
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target.relative_to(EXAMPLES_DIR.parent)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run `python examples/build_notebooks.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
