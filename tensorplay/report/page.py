"""Write the report as one self-contained HTML page: figures inline as PNG, no script, no network."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from html import escape

__all__ = ["Section", "Picture", "html_page"]


@dataclass(frozen=True)
class Picture:
    """A drawn figure: PNG bytes and its size in pixels."""

    png: bytes
    width: int
    height: int


@dataclass(frozen=True)
class Section:
    """One part of the report: a title, a one-line caption saying how to read it, a picture or a note."""

    key: str
    title: str
    caption: str
    picture: Picture | None
    note: str = ""
    """Shown instead of the picture when the run has nothing to draw there."""


_STYLE = """
body { font-family: "DejaVu Sans", "Helvetica Neue", Arial, sans-serif; margin: 1.5em auto; max-width: 1120px;
       padding: 0 1em; color: #222; background: #fff; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.15em; margin: 1.6em 0 0.2em; }
p.run { color: #555; margin-top: 0; }
p.how { color: #444; margin: 0.2em 0 0.6em; font-size: 0.95em; }
p.note { color: #666; font-style: italic; }
.verdict { border-left: 4px solid #d62728; padding: 0.4em 0.8em; background: #fdf3f3; }
.verdict.none { border-color: #2ca02c; background: #f3fbf3; }
.problems { border-left: 4px solid #ff7f0e; padding: 0.4em 0.8em; background: #fff7ef; }
img { max-width: 100%; height: auto; display: block; }
code { font-size: 0.95em; }
"""


def _section(section: Section) -> str:
    body = (f'<img alt="{escape(section.title)}" width="{section.picture.width}" height="{section.picture.height}" '
            f'src="data:image/png;base64,{base64.b64encode(section.picture.png).decode("ascii")}">'
            if section.picture is not None else f'<p class="note">{escape(section.note)}</p>')
    return (f'<section id="{escape(section.key)}">\n<h2>{escape(section.title)}</h2>\n'
            f'<p class="how">{escape(section.caption)}</p>\n{body}\n</section>')


def html_page(title: str, run_line: str, verdict: str, straggler_found: bool, problems: list[str],
              sections: list[Section]) -> str:
    """The whole page: title, what was read, the straggler verdict, input problems, the sections."""
    problem_items = "".join(f"<li>{escape(problem)}</li>" for problem in problems)
    problem_block = (f'<section class="problems" id="problems"><h2>Input that could not be read</h2>'
                     f"<ul>{problem_items}</ul><p>Everything else was read and is drawn below.</p></section>\n"
                     if problems else "")
    verdict_class = "verdict" if straggler_found else "verdict none"
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title>",
        f"<style>{_STYLE}</style></head>",
        "<body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="run">{escape(run_line)}</p>',
        f'<section class="{verdict_class}" id="verdict"><strong>straggler:</strong> {escape(verdict)}</section>',
        problem_block,
        *(_section(section) for section in sections),
        "</body></html>",
        "",
    ])
