"""kvpilot.policies.typed_config: the one converter, on small structs of its own. Each config
type's table (router, connector, specs) is in its package's tests."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Literal

import msgspec
import pytest

from kvpilot.policies.typed_config import TypedConfig, TypedConfigError, check_range, convert


class DocumentError(TypedConfigError):
    ROOT_KEY = "<doc>"


class Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class Leaf(TypedConfig, frozen=True):
    error_type = DocumentError

    size: int = 1
    ratio: float | None = None
    colour: Colour = Colour.RED
    shape: Literal["round", "square"] = "round"

    def __post_init__(self) -> None:
        check_range(self, "size", above=0)
        check_range(self, "ratio", above=0, at_most=1)


class Document(TypedConfig, frozen=True):
    error_type = DocumentError

    leaf: Leaf = msgspec.field(default_factory=Leaf)
    leaves: tuple[Leaf, ...] = ()
    by_name: Mapping[str, Leaf] = msgspec.field(default_factory=dict)
    colours: Mapping[str, Colour] = msgspec.field(default_factory=dict)


@pytest.mark.parametrize(
    ("data", "key", "problem"),
    [
        ({"leaf": {"sise": 2}}, "leaf.sise", "unknown key (known: size, ratio, colour, shape)"),
        ({"leaves": [{}, {"sise": 2}]}, "leaves[1].sise", "unknown key"),
        ({"by_name": {"a": {}, "b": {"sise": 2}}}, "by_name.b.sise", "unknown key"),
        ({"leaf": {"size": 1.5}}, "leaf.size", "Expected `int`, got `float`"),
        ({"leaf": {"size": True}}, "leaf.size", "Expected `int`, got `bool`"),
        ({"leaves": [{"ratio": "half"}]}, "leaves[0].ratio", "Expected `float | null`, got `str`"),
        ({"leaf": {"colour": "green"}}, "leaf.colour", "must be one of 'red', 'blue', got 'green'"),
        ({"leaf": {"shape": "oval"}}, "leaf.shape", "must be one of 'round', 'square', got 'oval'"),
        ({"colours": {"sky": "blue", "grass": "green"}}, "colours.grass", "must be one of 'red', 'blue'"),
        ({"leaf": {"size": 0}}, "leaf.size", "must be a finite number > 0, got 0"),
        ({"by_name": {"a": {"ratio": 1.5}}}, "by_name.a.ratio", "must be a finite number > 0 and <= 1, got 1.5"),
        ({"leaves": [{}, {}, {"size": -1}]}, "leaves[2].size", "> 0, got -1"),
        ({"leaf": 3}, "leaf", "Expected `object`, got `int`"),
        ([1], "<doc>", "Expected `object`, got `array`"),
    ],
)
def test_errors_name_the_dotted_key(data: object, key: str, problem: str) -> None:
    with pytest.raises(DocumentError) as err:
        convert(data, Document)
    assert err.value.key == key
    assert problem in err.value.problem
    assert str(err.value) == f"{key}: {err.value.problem}"


def test_a_missing_required_key_is_named() -> None:
    class Needs(TypedConfig, frozen=True):
        size: int

    with pytest.raises(TypedConfigError) as err:
        convert({}, Needs)
    assert (err.value.key, err.value.problem) == ("size", "missing required key")


def test_converts_strings_to_enums_and_leaves_the_input_alone() -> None:
    data = {"leaf": {"colour": "blue", "ratio": 1}, "colours": {"sky": "blue"}}
    doc = convert(data, Document)
    assert doc.leaf.colour is Colour.BLUE and doc.colours["sky"] is Colour.BLUE
    assert doc.leaf.ratio == 1.0
    assert data == {"leaf": {"colour": "blue", "ratio": 1}, "colours": {"sky": "blue"}}


@pytest.mark.parametrize(
    ("value", "ok"),
    [(1, True), (0.5, True), (None, True), (0, False), (-1, False), (float("nan"), False), (True, False), ("1", False)],
)
def test_check_range_wants_finite_numbers_in_bounds(value: object, ok: bool) -> None:
    leaf = msgspec.structs.replace(Leaf(), ratio=None)
    msgspec.structs.force_setattr(leaf, "ratio", value)
    if ok:
        check_range(leaf, "ratio", above=0, at_most=1)
    else:
        with pytest.raises(DocumentError, match=r"^ratio: must be a finite number > 0 and <= 1, got "):
            check_range(leaf, "ratio", above=0, at_most=1)


def test_direct_construction_runs_the_checks_too() -> None:
    with pytest.raises(DocumentError, match=r"^size: must be a finite number > 0, got 0$"):
        Leaf(size=0)
