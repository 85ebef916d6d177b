"""Write the report as one self-contained HTML page: figures inline as PNG, no script, no network."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from html import escape

__all__ = ["Section", "Picture", "ModelPart", "Findings", "html_page"]


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
    table: tuple[tuple[str, ...], list[tuple[str, ...]]] | None = None
    """Column names and rows of cells, shown first, above the picture."""
    paragraphs: tuple[str, ...] = ()
    """What the section says in words, below its table and above its picture."""


@dataclass(frozen=True)
class ModelPart:
    """One model's part of the page: its verdict, its per-rank table and its sections."""

    heading: str
    """Names the model when the run has several; empty otherwise."""
    verdict: str
    straggler_found: bool
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    sections: list[Section]
    unjudged: bool = False
    """Some ranks of the job have no spans: a verdict of none is not a clean bill."""


@dataclass(frozen=True)
class Findings:
    """What the whole run says beyond its models: a sentence each, and whether any names a problem."""

    lines: list[str]
    problem: bool


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
.verdict.unjudged { border-color: #ff7f0e; background: #fff7ef; }
.problems { border-left: 4px solid #ff7f0e; padding: 0.4em 0.8em; background: #fff7ef; }
#sync { margin-top: 1.6em; }
img { max-width: 100%; height: auto; display: block; }
code { font-size: 0.95em; }
table.ranks { border-collapse: collapse; font-size: 0.7em; margin: 0.8em 0; }
table.ranks th, table.ranks td { padding: 0.15em 0.3em; text-align: right; border-bottom: 1px solid #ddd;
                                white-space: nowrap; }
table.ranks th { white-space: normal; vertical-align: bottom; }
p.says { margin: 0.3em 0; }
table.figures { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
table.figures th, table.figures td { padding: 0.15em 0.6em; text-align: right; border-bottom: 1px solid #ddd; }
table.figures td:first-child, table.figures th:first-child { text-align: left; }
"""


def _section(section: Section, prefix: str) -> str:
    table = f'class="figures" id="{escape(prefix + section.key)}-table"'
    says = "" if section.table is None else _cells(*section.table, table) + "\n"
    says += "".join(f'<p class="says">{escape(paragraph)}</p>\n' for paragraph in section.paragraphs)
    body = says + (f'<img alt="{escape(section.title)}" width="{section.picture.width}" '
                   f'height="{section.picture.height}" '
                   f'src="data:image/png;base64,{base64.b64encode(section.picture.png).decode("ascii")}">'
                   if section.picture is not None else f'<p class="note">{escape(section.note)}</p>')
    return (f'<section id="{escape(prefix + section.key)}">\n<h2>{escape(section.title)}</h2>\n'
            f'<p class="how">{escape(section.caption)}</p>\n{body}\n</section>')


def _cells(columns: tuple[str, ...], rows: list[tuple[str, ...]], attributes: str) -> str:
    head = "".join(f"<th>{escape(column)}</th>" for column in columns)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table {attributes}><tr>{head}</tr>{body}</table>"


def _table(part: ModelPart, prefix: str) -> str:
    return _cells(part.columns, part.rows, f'class="ranks" id="{prefix}ranks"')


def _model(part: ModelPart, index: int, several: bool) -> str:
    prefix = f"model{index}-" if several else ""
    verdict_class = "verdict" if part.straggler_found else "verdict unjudged" if part.unjudged else "verdict none"
    heading = f'<h1 id="{prefix}model">{escape(part.heading)}</h1>\n' if part.heading else ""
    return "\n".join([
        heading + f'<section class="{verdict_class}" id="{prefix}verdict"><strong>straggler:</strong> '
        f"{escape(part.verdict)}</section>",
        _table(part, prefix),
        *(_section(section, prefix) for section in part.sections),
    ])


def _findings(findings: Findings) -> str:
    items = "".join(f"<li>{escape(line)}</li>" for line in findings.lines)
    css = "verdict" if findings.problem else "verdict none"
    return (f'<section class="{css}" id="sync"><strong>Gradient synchronisation</strong> (every optimizer step over the '
            f"traced models, every rank)<ul>{items}</ul></section>")


def html_page(title: str, run_line: str, problems: list[str], parts: list[ModelPart], findings: Findings) -> str:
    """The whole page: title, what was read, input problems, per model its verdict, table and sections, then the run's findings."""
    problem_items = "".join(f"<li>{escape(problem)}</li>" for problem in problems)
    problem_block = (f'<section class="problems" id="problems"><h2>Input that could not be read, or is missing</h2>'
                     f"<ul>{problem_items}</ul><p>Everything else was read and is drawn below.</p></section>\n"
                     if problems else "")
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
        problem_block,
        *(_model(part, index, len(parts) > 1) for index, part in enumerate(parts)),
        _findings(findings),
        "</body></html>",
        "",
    ])
