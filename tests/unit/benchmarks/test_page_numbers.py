"""Every measured number on the README and the benchmark pages is what a named field of a
named results file renders (:mod:`benchmarks.page_numbers`), and no other figure passes for it."""

from __future__ import annotations

import pytest

from benchmarks.page_numbers import PAGES, README, ROOT, Marked, check, markers, perturbed, render, unsourced, wrong

MARKED = [m for page in PAGES for m in markers(page)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_each_number_on_the_page_is_what_its_source_renders(page) -> None:
    assert not check(page), "\n".join(check(page))


def test_the_readme_headlines_are_sourced() -> None:
    assert sum(1 for m in MARKED if m.page == README) >= 20


@pytest.mark.parametrize("marked", MARKED, ids=[f"{m.where}:{m.printed}{m.unit}" for m in MARKED])
def test_a_number_one_off_in_its_last_digit_fails(marked: Marked) -> None:
    for other in perturbed(marked.printed):
        changed = Marked(marked.page, marked.line, other, marked.unit, marked.stem, marked.expr, marked.start)
        assert wrong(changed), f"{marked.where}: {other} passes where {marked.printed} is printed"


def test_rounding_keeps_the_page_s_precision_and_grouping() -> None:
    assert render(1.5049, "1.50") == "1.50"
    assert render(0.125, "0.12") == "0.12"  # half to even: one text per value
    assert render(12467.0, "12,467") == "12,467"
    assert render(533.8059, "533.8") == "533.8"
    assert perturbed("1,024") == ["1,025", "1,023"] and perturbed("0.0") == ["0.1"]


def test_a_marker_with_a_bad_source_is_named(tmp_path, monkeypatch) -> None:
    page = ROOT / "docs" / "benchmarks" / "made-up.md"
    stem = "scale-14k"
    for text, why in [
        (f"1.0<!--={stem}: no_such_field-->", "no field"),
        ("1.0<!--=no-such-results: a-->", "no results file"),
        (f"1.0<!--={stem}: __import__('os')-->", "outside the expression language"),
        ("1.0<!--=: a-->", "none is set above it"),
    ]:
        (problem,) = check(page, text)
        assert why in problem, problem


def test_a_number_without_a_source_is_named() -> None:
    page = ROOT / "docs" / "benchmarks" / "made-up.md"
    text = (
        "# Heading 64\n"
        "kvpilot 12.6 MB, `--workers 16`, vllm#43094, Dynamo 1.6.1, section 9.2, [64](results/x.json)\n"
        '--8<-- "docs/benchmarks/tables/scale-14k.md"\n'
        "| arm | 4.3x |\n"
    )
    assert unsourced(page, text) == [(2, "12.6"), (2, "64"), (4, "4.3")]
