"""HTML reports of fitune's answers: self-contained pages (inline CSS, JS and SVG; nothing fetched at view time).

`render_html(kind, doc)` turns the JSON a command prints with --json (for `train`, the document `read_run` makes
of a run folder) into a page; `write_html` saves it. `add_html_argument` / `maybe_write_html` give any subcommand
an `--html FILE` flag. Pure Python: no torch.
"""

from __future__ import annotations

import os
import sys

from ..errors import FituneError
from ..files import check_target, write_text_atomic
from .charts import HATCH_DEFS
from .html import page
from .load import KINDS, load_document, read_source
from .train import read_run, render as render_train

__all__ = ["KINDS", "render_html", "write_html", "add_html_argument", "maybe_write_html", "load_document", "read_run"]


def render_html(kind: str, doc, *, measured: dict | None = None, refresh_s: int | None = None) -> str:
    """The page for `doc`, the JSON document of `fitune KIND --json`.

    Args:
        kind: estimate | plan | profile | train | doctor.
        doc: estimate / plan / profile: the --json object. train: `read_run(run_dir)`. doctor: the --json findings
            list, or {"script", "source", "findings"} to show the script with the findings on their lines.
        measured: estimate only: a `fitune profile --json` document of the same setup, shown beside the estimate.
        refresh_s: reload the page every that many seconds (a run that is still going).

    Raises:
        FituneError: an unknown kind.
    """
    if kind == "train" and isinstance(doc, (str, os.PathLike)):
        doc = read_run(os.fspath(doc))
    if kind == "estimate":
        # the command's library: imported when it runs, so that `fitune --help` stays light
        from .estimate import render

        title, body = render(doc, measured)
    elif kind == "plan":
        from .plan import render

        title, body = render(doc)
    elif kind == "profile":
        from .profile import render

        title, body = render(doc)
    elif kind == "train":
        title, body = render_train(doc)
    elif kind == "doctor":
        from .doctor import render

        title, body = render(doc)
    else:
        raise FituneError(f"unknown report {kind!r}; known: {', '.join(KINDS)}")
    return page(title, kind, HATCH_DEFS + body, refresh_s)


def write_html(kind: str, doc, path: str, *, what: str = "--html", **options) -> str:
    """Render and save the page; the file is replaced whole (a browser reloading it never sees half a page),
    through a temporary file no link can redirect (fitune/files.py). Returns `path`.

    Raises:
        UnsafeFileError: `path` is a symbolic link, FIFO, socket, device or folder, or the write failed (`what`,
            the flag that named it, is in the message).
    """
    check_target(path, what)  # before rendering, and before making its folder
    text = render_html(kind, doc, **options)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return write_text_atomic(path, text, what=what)


def add_html_argument(parser) -> None:
    """Give a subcommand `--html FILE.html` (then call `maybe_write_html(args, kind, doc)` once it has its JSON)."""
    parser.add_argument("--html", metavar="FILE.html", help="also write the answer as a self-contained HTML page "
                        "(charts; open it in a browser; the same page as `fitune report`)")


def maybe_write_html(args, kind: str, doc) -> str | None:
    """When the user passed --html FILE: write the page of `doc` (what --json prints; for `train` the run folder
    or its `read_run`; for `doctor` the findings list, whose script, `args.script`, is shown with them), say so
    on stderr and return the path. Otherwise None."""
    path = getattr(args, "html", None)
    if not path:
        return None
    if kind == "doctor":
        from .doctor import as_doc
        script = getattr(args, "script", None)
        doc = as_doc(doc, script, read_source(script) if script else None)
    write_html(kind, doc, path)
    print(f"wrote {path} (open it in a browser)", file=sys.stderr)
    return path
