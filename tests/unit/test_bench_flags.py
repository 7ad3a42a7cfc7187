"""Each benchmark's flags come from its config struct: `--help` lists every field, an empty command
line gives the struct's defaults, and a typed flag reaches its field. The shared options are
declared once (bench/options.py) and keep their meaning in every benchmark that takes them."""

from __future__ import annotations

import argparse
import subprocess
import sys
from types import ModuleType

import msgspec
import pytest

from pilotfish.bench import cluster, fidelity, matrix, options, reschedule, scheduler, sim_capacity, sim_speed
from pilotfish.config import add_struct_arguments, struct_from_args

BENCHES: list[tuple[ModuleType, type[msgspec.Struct]]] = [
    (cluster, cluster.ClusterBenchConfig),
    (reschedule, reschedule.RescheduleBenchConfig),
    (sim_speed, sim_speed.SimSpeedConfig),
    (sim_capacity, sim_capacity.SimCapacityConfig),
    (fidelity, fidelity.FidelityConfig),
    (scheduler, scheduler.SchedulerBenchConfig),
    (matrix, matrix.MatrixConfig),
]
IDS = [module.__name__.rsplit(".", 1)[1] for module, _ in BENCHES]


def _parser(module: ModuleType) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=module.__name__)
    module.add_arguments(parser)
    return parser


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize(("module", "struct"), BENCHES, ids=IDS)
def test_the_flags_are_the_structs_fields_and_nothing_else(module: ModuleType, struct: type[msgspec.Struct]) -> None:
    parser = _parser(module)
    given = {s for action in parser._actions for s in action.option_strings} - {"-h", "--help"}
    fields = msgspec.structs.fields(struct)
    expected = {_flag(f.name) for f in fields}
    expected |= {"--no-" + _flag(f.name)[2:] for f in fields if isinstance(f.default, bool)}  # on and off
    assert given == expected
    help_text = parser.format_help()
    for f in fields:
        assert _flag(f.name) in help_text


@pytest.mark.parametrize(("module", "struct"), BENCHES, ids=IDS)
def test_an_empty_command_line_gives_the_structs_defaults(module: ModuleType, struct: type[msgspec.Struct]) -> None:
    assert struct_from_args(struct, _parser(module).parse_args([])) == struct()


@pytest.mark.parametrize(
    ("module", "struct", "argv", "field", "value"),
    [
        (cluster, cluster.ClusterBenchConfig, ["--sweep", ""], "sweep", []),
        (cluster, cluster.ClusterBenchConfig, ["--policies", "oracle,dynamo"], "policies", ["oracle", "dynamo"]),
        (cluster, cluster.ClusterBenchConfig, ["--no-progress"], "progress", False),
        (reschedule, reschedule.RescheduleBenchConfig, ["--load-threshold", "0.3"], "load_threshold", 0.3),
        (sim_speed, sim_speed.SimSpeedConfig, ["--routers", "round-robin"], "routers", ["round-robin"]),
        (fidelity, fidelity.FidelityConfig, ["--rates", "4,80,240"], "rates", [4.0, 80.0, 240.0]),
        (fidelity, fidelity.FidelityConfig, ["--no-track-speed"], "track_speed", False),
        (scheduler, scheduler.SchedulerBenchConfig, ["--sizes", "16", "--decisions-only"], "sizes", [16]),
    ],
)
def test_a_typed_flag_reaches_its_field(
    module: ModuleType, struct: type[msgspec.Struct], argv: list[str], field: str, value: object
) -> None:
    assert getattr(struct_from_args(struct, _parser(module).parse_args(argv)), field) == value


def test_a_bad_value_fails_at_start_up_naming_the_flag() -> None:
    from pilotfish.config import ConfigError

    args = _parser(cluster).parse_args(["--matrix-at", "everywhere"])
    with pytest.raises(ConfigError, match="--matrix-at"):
        struct_from_args(cluster.ClusterBenchConfig, args)
    args = _parser(reschedule).parse_args(["--scenarios", "load_balance,nonsense"])
    with pytest.raises(ConfigError, match="--scenarios"):
        struct_from_args(reschedule.RescheduleBenchConfig, args)


def test_the_shared_options_mean_the_same_in_every_virtual_time_benchmark() -> None:
    """A field the base structs declare is described once: a benchmark that overrides its default
    keeps the shared description unless it says why it differs (reschedule's smaller KV)."""

    def described(struct: type[msgspec.Struct]) -> dict[str, str]:
        parser = argparse.ArgumentParser()
        add_struct_arguments(parser, struct)
        return {a.dest: a.help.split(" (default:")[0] for a in parser._actions if a.dest != "help"}

    shared = described(options.ClusterRunOptions)
    for struct, own in ((cluster.ClusterBenchConfig, set()), (reschedule.RescheduleBenchConfig, {"num_gpu_blocks"})):
        mine = described(struct)
        assert {k: v for k, v in mine.items() if k in shared and k not in own} == {
            k: v for k, v in shared.items() if k not in own
        }
    engine = described(options.EngineOptions)
    assert {k: described(sim_speed.SimSpeedConfig)[k] for k in engine} == engine


def test_the_capacity_server_takes_its_flags_from_its_struct() -> None:
    from pilotfish.bench.sim_capacity_server import ServerConfig

    proc = subprocess.run([sys.executable, "-m", "pilotfish.bench.sim_capacity_server", "--help"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for f in msgspec.structs.fields(ServerConfig):
        assert _flag(f.name) in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "pilotfish.bench.sim_capacity_server"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "timings" in proc.stderr  # the one required field, named
