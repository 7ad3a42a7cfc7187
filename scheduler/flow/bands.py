"""Priority bands: the vocabulary is scheduler.proto's Priority, strict order between bands.

A request's band is the one its gateway sent; unspecified (or a value newer than this scheduler)
falls to the band --flow-model-priorities gives its model (an InferenceObjective's priority),
else standard.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from pilotfish.config import ConfigError
from pilotfish.protos import scheduler_pb2


class Band(enum.IntEnum):
    """Lower value, served first. The values are scheduler.proto's Priority."""

    CRITICAL = scheduler_pb2.PRIORITY_CRITICAL
    STANDARD = scheduler_pb2.PRIORITY_STANDARD
    SHEDDABLE = scheduler_pb2.PRIORITY_SHEDDABLE

    @property
    def label(self) -> str:
        return self.name.lower()


BANDS = tuple(Band)  # in dispatch order
BY_NAME = {b.label: b for b in Band}


def parse_model_priorities(entries: Iterable[str]) -> dict[str, Band]:
    """`model=band` each (--flow-model-priorities); ConfigError naming the entry otherwise."""
    out: dict[str, Band] = {}
    for entry in entries:
        model, sep, name = entry.partition("=")
        band = BY_NAME.get(name.strip().lower())
        if not sep or not model.strip() or band is None:
            raise ConfigError(f"--flow-model-priorities: {entry!r} is not model=band (band: {', '.join(BY_NAME)})")
        out[model.strip()] = band
    return out


def band_of(priority: int, model: str, by_model: Mapping[str, Band]) -> Band:
    """The request's band: its own priority, else its model's, else standard."""
    if priority in (Band.CRITICAL, Band.STANDARD, Band.SHEDDABLE):
        return Band(priority)
    return by_model.get(model, Band.STANDARD)
