"""The simulator's settings: flags, YAML and validation (README tables: tests/unit/test_readme.py)."""

from __future__ import annotations

import argparse

import pytest

from pilotfish.config import ConfigError
from pilotfish.simulator.config import EngineConfig, ServeConfig, add_arguments, configs_from_args


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_override_yaml_and_defaults_live_in_the_structs(tmp_path) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text("engines: 3\nmax-num-seqs: 4\nmodel: m\n")
    serve, engine = configs_from_args(_parse(["--config", str(path), "--model", "flag", "--ports", "9001,9002"]))
    assert serve.engines == 3 and serve.model == "flag" and serve.resolved_ports() == [9001, 9002]
    assert engine.max_num_seqs == 4
    assert engine.block_size == EngineConfig().block_size
    assert configs_from_args(_parse([])) == (ServeConfig(), EngineConfig())


@pytest.mark.parametrize(
    ("argv", "yaml_text"),
    [
        (["--engines", "0"], None),
        (["--step-ms", "-1"], None),
        (["--ports", "9001,9001"], None),
        ([], "no_such_key: 1\n"),
    ],
)
def test_bad_config_is_one_line_error(tmp_path, argv: list[str], yaml_text: str | None) -> None:
    if yaml_text is not None:
        path = tmp_path / "sim.yaml"
        path.write_text(yaml_text)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(ConfigError) as exc:
        configs_from_args(_parse(argv))
    assert "\n" not in str(exc.value)
