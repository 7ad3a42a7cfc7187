"""bench llumlet-cachesim: its cycle of steps runs the hooks as it says, and its reading of callgrind's files."""

from __future__ import annotations

import pytest

from pilotfish.bench import llumlet_cachesim as bench


@pytest.mark.parametrize("kind", bench.KINDS)
@pytest.mark.parametrize("llumlet_on", [True, False])
def test_each_cycle_comes_back_to_its_start(kind: str, llumlet_on: bool) -> None:
    bench.child(kind, llumlet_on, steps=3)  # raises if the cycle left a request behind


def test_callgrind_totals_are_read_by_event_name() -> None:
    text = (
        "version: 1\ncreator: callgrind-3.19.0\nevents: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\n\n"
        "summary: 10 20 30 4 5 6 7 8 9\n"
    )
    assert bench.read_totals(text) == {
        "Ir": 10, "Dr": 20, "Dw": 30, "I1mr": 4, "D1mr": 5, "D1mw": 6, "ILmr": 7, "DLmr": 8, "DLmw": 9,
    }  # fmt: skip
    with pytest.raises(RuntimeError, match="not a callgrind output"):
        bench.read_totals("events: Ir\n")
