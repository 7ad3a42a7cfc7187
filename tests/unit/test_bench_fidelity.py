"""bench fidelity's speed tracking: the arithmetic and the profiles it writes (the runs themselves
need vLLM and minutes; `pilotfish bench fidelity` is run by hand, see the README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilotfish.bench import fidelity
from pilotfish.simulator.calibrate.saturation import at_speed
from pilotfish.simulator.engine.step_time import StepTimeProfile, load_profile

PROFILE = StepTimeProfile(name="fit", base_ms=2.4, prefill_ms_per_token=0.013, decode_ms_per_token=0.12,
                          context_ms_per_token=0.0003, api_overhead_ms=3.5, shared_cpu=True)  # fmt: skip


def test_each_run_gets_the_mean_speed_of_the_probes_around_it() -> None:
    # probes before run 1, between runs 1 and 2, after run 2; the calibration's phase took 2.0 s
    assert fidelity.slowdowns([2.0, 3.0, 4.5], 2.0) == pytest.approx([6**0.5 / 2, 13.5**0.5 / 2])
    assert fidelity.slowdowns([2.0], 2.0) == []  # no run bracketed: nothing to track


def test_the_profile_at_a_speed_loads_back_with_every_time_term_scaled(tmp_path: Path) -> None:
    path = fidelity._profile_at(PROFILE, 1.3, tmp_path, "run1-80")
    assert Path(path).name == "profile-run1-80.yaml"
    loaded = load_profile(path)
    assert loaded == at_speed(PROFILE, 1.3)
    assert loaded.base_ms == pytest.approx(2.4 * 1.3) and loaded.api_overhead_ms == pytest.approx(3.5 * 1.3)
    assert loaded.shared_cpu and loaded.name == "fit"
