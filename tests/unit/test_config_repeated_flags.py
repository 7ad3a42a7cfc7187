"""A list field marked REPEATED is one flag per item, so an item may hold commas."""

from __future__ import annotations

import argparse
from typing import Annotated

import msgspec
from msgspec import Meta

from pilotfish.config import REPEATED, add_struct_arguments, struct_from_args


class _Cfg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    variant: Annotated[list[str], Meta(description="one more arm", extra=REPEATED)] = msgspec.field(
        default_factory=lambda: ["default:A=1"]
    )
    loads: Annotated[list[float], Meta(description="loads")] = msgspec.field(default_factory=list)


def _parse(argv: list[str]) -> _Cfg:
    parser = argparse.ArgumentParser()
    add_struct_arguments(parser, _Cfg)
    return struct_from_args(_Cfg, parser.parse_args(argv))


def test_each_use_adds_one_item_whole_and_the_first_replaces_the_default() -> None:
    assert _parse([]).variant == ["default:A=1"]
    assert _parse(["--variant", "a:X=1,Y=2", "--variant", "b:Z=3"]).variant == ["a:X=1,Y=2", "b:Z=3"]


def test_an_unmarked_list_stays_one_comma_separated_flag() -> None:
    assert _parse(["--loads", "1,2.5"]).loads == [1.0, 2.5]
