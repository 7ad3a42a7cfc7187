"""The real-process benchmarks take their flags from one config struct each, under the names and
defaults the READMEs and scripts use."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import msgspec
import pytest

from pilotfish.bench import ext_proc_protos, llumlet_cachesim, llumlet_overhead, llumlet_staleness, realtime
from pilotfish.bench.ext_proc_protos_config import ProtosBenchConfig
from pilotfish.config import struct_from_args

AddArguments = Callable[[argparse.ArgumentParser], None]

# benchmark -> (its add_arguments, its struct, the flags the READMEs, docs and scripts use)
BENCHES: dict[str, tuple[AddArguments, type[msgspec.Struct], str]] = {
    "realtime": (
        realtime.add_arguments,
        realtime.RealtimeBenchConfig,
        "--trace --trace-dir --skip --requests --load --loads --reps --engines --targets --token-scale --profile "
        "--num-gpu-blocks --vllm-router --sglang-router --request-timeout --seed --agreement --no-progress",
    ),
    "protos": (ext_proc_protos.add_arguments, ProtosBenchConfig, "--iterations --repeats --edp-python"),
    "llumlet": (
        llumlet_overhead.add_arguments,
        llumlet_overhead.LlumletOverheadConfig,
        "--rounds --requests --concurrency --max-tokens --model-dir --vllm-cpus --llumlet-env --variant",
    ),
    "llumlet-staleness": (
        llumlet_staleness.add_arguments,
        llumlet_staleness.LlumletStalenessConfig,
        "--events --interval-us --burst --burst-gap-ms --engine --switch-interval-us --redis-url --write-from",
    ),
    "llumlet-cachesim": (llumlet_cachesim.add_arguments, llumlet_cachesim.LlumletCachesimConfig, "--steps"),
}


def _parser(add: AddArguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser


@pytest.mark.parametrize("name", BENCHES)
def test_every_field_is_a_flag_and_no_flag_given_is_the_structs_default(name: str) -> None:
    add, struct, documented = BENCHES[name]
    parser = _parser(add)
    flags = set(parser._option_string_actions)
    fields = {"--" + f.name.replace("_", "-") for f in msgspec.structs.fields(struct)}
    assert fields <= flags
    assert set(documented.split()) <= flags  # the names in use still parse
    assert struct_from_args(struct, parser.parse_args([])) == struct()


@pytest.mark.parametrize("name", BENCHES)
def test_help_shows_each_fields_default(name: str) -> None:
    add, struct, _ = BENCHES[name]
    text = " ".join(_parser(add).format_help().split())  # argparse wraps lines
    for f in msgspec.structs.fields(struct):
        assert "--" + f.name.replace("_", "-") in text
    assert text.count("(default:") >= len(msgspec.structs.fields(struct))


def test_realtime_lists_and_switches_read_as_before() -> None:
    parser = _parser(realtime.add_arguments)
    cfg = struct_from_args(
        realtime.RealtimeBenchConfig,
        parser.parse_args(["--loads", "1,3", "--targets", "direct-rr,pilotfish-lite", "--no-progress", "--agreement"]),
    )
    assert cfg.loads == [1.0, 3.0] and cfg.targets == ["direct-rr", "pilotfish-lite"]
    assert cfg.progress is False and cfg.agreement is True
    assert realtime.parse_loads(cfg.load, cfg.loads) == [1.0, 2.0, 3.0]  # --load is always run


def test_llumlet_variants_keep_their_commas_and_none_still_means_none() -> None:
    parser = _parser(llumlet_overhead.add_arguments)
    cfg = struct_from_args(
        llumlet_overhead.LlumletOverheadConfig,
        parser.parse_args(["--variant", "slow:PILOTFISH_A=1,PILOTFISH_B=2", "--llumlet-env", "PILOTFISH_C=x,y"]),
    )
    assert llumlet_overhead._variants(cfg.variant) == {"slow": {"PILOTFISH_A": "1", "PILOTFISH_B": "2"}}
    assert cfg.llumlet_env == ["PILOTFISH_C=x,y"]
    none = struct_from_args(llumlet_overhead.LlumletOverheadConfig, parser.parse_args(["--variant", "none"]))
    assert llumlet_overhead._variants(none.variant) == {}
    default = llumlet_overhead.LlumletOverheadConfig()
    assert llumlet_overhead._variants(default.variant) == llumlet_overhead._variants(None)


@pytest.mark.parametrize("reps", [1, 2, 3, 4])
def test_realtime_runs_every_target_once_a_repetition_in_rotated_order(reps: int) -> None:
    targets = ["a", "b", "c"]
    order = realtime.rotations(targets, reps)
    assert len(order) == reps * len(targets)
    for rep in range(reps):
        names = [name for r, _, name in order if r == rep]
        assert sorted(names) == targets and names[0] == targets[rep % len(targets)]
    firsts = {name for _, position, name in order if position == 0}
    assert len(firsts) == min(reps, len(targets))  # no target always first


def test_protos_pairs_the_two_libraries_by_repeat() -> None:
    def sample(total_us: float, sha: str = "same") -> dict:
        phases = {ph: {"cpu_s": total_us * 10 / 1e6, "wall_s": total_us * 10 / 1e6, "requests": 10}
                  for ph in ext_proc_protos.PHASES}  # fmt: skip
        return {"version": "1", "runtime": "r", "wire_sha256": sha, "phases": phases}

    runs = {ext_proc_protos.XDS: [sample(10.0), sample(20.0)], ext_proc_protos.EDP: [sample(400.0), sample(400.0)]}
    libs = {lib: ext_proc_protos._library(samples, "python") for lib, samples in runs.items()}
    assert libs[ext_proc_protos.XDS]["us_per_request"]["total"]["median"] == pytest.approx(15.0)
    compared = ext_proc_protos._comparison(runs, libs)
    # per repeat 40x and 20x: the median of the ratios, not the ratio of the medians (400 / 15)
    assert compared["ratio_edp_over_xds"]["total"]["median"] == pytest.approx(30.0)
    assert compared["wire_identical"] is True and compared["faster"] == ext_proc_protos.XDS
