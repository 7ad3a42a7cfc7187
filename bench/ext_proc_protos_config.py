"""`pilotfish bench protos`'s settings, apart from the benchmark: its worker runs ext_proc_protos.py as
a script in a virtualenv that may hold nothing but envoy-data-plane, so that file imports only the
standard library, and the config struct (msgspec) lives here."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from pilotfish.bench.ext_proc_protos import DEFAULT_ITERATIONS, DEFAULT_REPEATS, EDP_PYTHON_ENV, MIN_PHASE_S


class ProtosBenchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    iterations: Annotated[
        int,
        Meta(
            ge=1, description=f"requests per phase per repeat, at least (a phase goes on until {MIN_PHASE_S} s of CPU)"
        ),
    ] = DEFAULT_ITERATIONS
    repeats: Annotated[int, Meta(ge=1, description="fresh-process repeats per library")] = DEFAULT_REPEATS
    edp_python: Annotated[
        str | None,
        Meta(description=f"a Python that has envoy-data-plane, when this one has not (also ${EDP_PYTHON_ENV})"),
    ] = None
