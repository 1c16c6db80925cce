"""Reading a Jupyter notebook (.ipynb) as the script the doctor checks, and saying where a line came from.

The code cells are joined in order into one Python source; markdown and raw cells are skipped. IPython's own
syntax is not Python: a line that starts with `!` (a shell command) or `%` (a line magic) is blanked, and a cell
that starts with `%%` (a cell magic: bash, writefile, ...) is blanked whole, so every other line keeps its place.
A blanked line inside an indented block becomes `pass` at that indentation, so the block still parses.

`Notebook.where(line)` turns a line of the joined source into "cell 3, line 2": cells are counted from 1 over every
cell of the notebook (markdown included), top to bottom as Jupyter shows them; lines from 1 within the cell.
Pure Python: the notebook is read with `json`, never run.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass

from ..schema import too_many_digits
from .findings import ScriptError

NOTEBOOK_SUFFIX = ".ipynb"
_LINE_REF = re.compile(r"\b(lines?) (\d+(?:(?:, | and )\d+)*)\b")
"""`line 12`, `lines 3, 5`, `lines 3 and 5` in a message: line numbers of the joined source."""


@dataclass(frozen=True)
class Notebook:
    """A notebook's code as one Python source, with the cell and line each source line came from."""

    path: str
    source: str
    """The code cells joined, magics and shell lines blanked (what the rules read)."""
    locations: tuple[tuple[int, int], ...]
    """For line n of `source` (1-based), `locations[n - 1]` = (cell number, line in that cell), both 1-based."""
    cells: tuple[tuple[int, str], ...]
    """(cell number, text as written) of every code cell: what a report shows."""

    def cell_line(self, line: int) -> tuple[int, int] | None:
        """(cell, line in the cell) of line `line` of the joined source; None when out of range."""
        if 1 <= line <= len(self.locations):
            return self.locations[line - 1]
        return None

    def where(self, line: int) -> str:
        """"cell 3, line 2" for line `line` of the joined source."""
        loc = self.cell_line(line)
        return f"cell {loc[0]}, line {loc[1]}" if loc else f"line {line}"

    def relabel(self, text: str) -> str:
        """`text` with its references to lines of the joined source ("line 12", "lines 3, 5") written as cells and
        lines ("cell 4, line 2", "cell 2, lines 1, 3")."""
        return _LINE_REF.sub(lambda m: self._lines_text([int(n) for n in re.findall(r"\d+", m.group(2))]), text)

    def locate_document(self, doc: dict) -> dict:
        """`fitune doctor NOTEBOOK --json`'s document with every line number made a line in its cell: each finding's
        `line` counts within its cell and a `cell` key says which; `setup.lines` and each fix's `lines` likewise, with
        `setup.cells` / the fix's `cells` beside them; text that names lines names cells. Returns `doc`, changed."""
        for f in doc.get("findings") or []:
            loc = self.cell_line(f["line"]) if f.get("line") is not None else None
            f["line"], f["cell"] = (loc[1], loc[0]) if loc else (f.get("line"), None)
        setup = doc.get("setup")
        if setup:
            joined = setup.get("lines") or {}
            setup["lines"] = {k: self._in_cells(v)[1] for k, v in joined.items()}
            setup["cells"] = {k: self._in_cells(v)[0] for k, v in joined.items()}
            setup["notes"] = [self.relabel(n) for n in setup.get("notes") or []]
            for a in (setup.get("assumed") or {}).values():
                a["why"] = self.relabel(a["why"])
        for fix in doc.get("fixes") or []:
            fix["cells"], fix["lines"] = self._in_cells(fix.get("lines") or [])
            fix["edits"] = [self.relabel(e) for e in fix.get("edits") or []]
        return doc

    def _in_cells(self, lines: list[int]) -> tuple[list[int | None], list[int]]:
        locs = [self.cell_line(n) for n in lines]
        return [loc[0] if loc else None for loc in locs], [loc[1] if loc else n for loc, n in zip(locs, lines)]

    def _lines_text(self, lines: list[int]) -> str:
        locs = [self.cell_line(n) for n in lines]
        if any(loc is None for loc in locs):
            return ("line " if len(lines) == 1 else "lines ") + ", ".join(map(str, lines))
        by_cell: dict[int, list[int]] = {}
        for cell, line in locs:
            by_cell.setdefault(cell, []).append(line)
        return " and ".join(f"cell {cell}, line{'s' if len(ls) > 1 else ''} {', '.join(map(str, ls))}"
                            for cell, ls in by_cell.items())


def read_notebook(path: str, text: str) -> Notebook:
    """The notebook at `path` (its file's `text`) as a `Notebook`.

    Raises:
        ScriptError: the text is not JSON, not a notebook (nbformat 4: {"cells": [...]}), or has no code cell.
    """
    def parse_int(number: str) -> int:  # int() refuses over 4,300 digits with a ValueError naming nothing
        digits = len(number.lstrip("-"))
        if digits > sys.get_int_max_str_digits():
            raise ScriptError(f"{path} is not a readable notebook: {too_many_digits(digits)}")
        return int(number)

    try:
        doc = json.loads(text, parse_int=parse_int)
    except json.JSONDecodeError as exc:
        raise ScriptError(f"{path} is not a readable notebook: not JSON ({exc.msg} at line {exc.lineno}, column "
                          f"{exc.colno}); save it again from Jupyter, or pass the training script (.py)") from None
    except RecursionError:  # JSON nested thousands of levels deep
        raise ScriptError(f"{path} is not a readable notebook: its JSON nests too deeply") from None
    cells = _cells(path, doc)
    lines: list[str] = []
    locations: list[tuple[int, int]] = []
    code_cells: list[tuple[int, str]] = []
    for number, cell in enumerate(cells, start=1):
        if cell.get("cell_type") != "code":
            continue
        text_of_cell = _cell_source(path, number, cell)
        code_cells.append((number, text_of_cell))
        for i, line in enumerate(_python_lines(text_of_cell), start=1):
            lines.append(line)
            locations.append((number, i))
    if not code_cells:
        raise ScriptError(f"{path} has no code cell: nothing to check; pass the notebook that trains, or its "
                          "training script (.py)")
    return Notebook(path, "\n".join(lines) + "\n", tuple(locations), tuple(code_cells))


def _cells(path: str, doc) -> list[dict]:
    if isinstance(doc, dict) and isinstance(doc.get("worksheets"), list):  # nbformat 3 (IPython 1-2)
        raise ScriptError(f"{path} is an nbformat {doc.get('nbformat', 3)} notebook; fitune reads nbformat 4: "
                          f"convert it with `jupyter nbconvert --to notebook --nbformat 4 {path}`")
    cells = doc.get("cells") if isinstance(doc, dict) else None
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise ScriptError(f"{path} is JSON but not a Jupyter notebook (no \"cells\" list of objects); pass a "
                          "notebook saved by Jupyter, or the training script (.py)")
    return cells


def _cell_source(path: str, number: int, cell: dict) -> str:
    src = cell.get("source", "")
    if isinstance(src, list) and all(isinstance(s, str) for s in src):
        return "".join(src)
    if isinstance(src, str):
        return src
    raise ScriptError(f"{path}: cell {number}'s \"source\" is {type(src).__name__}, not text; save the notebook "
                      "again from Jupyter")


def _python_lines(cell_text: str) -> list[str]:
    """The cell's lines with IPython syntax blanked: `!cmd` and `%magic` lines, and a whole `%%magic` cell."""
    lines = cell_text.split("\n")
    if cell_text.lstrip().startswith("%%"):
        return [""] * len(lines)
    out = []
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith(("!", "%")):
            indent = line[: len(line) - len(stripped)]
            line = f"{indent}pass" if indent else ""  # inside a block, keep the block a block
        out.append(line)
    return out
