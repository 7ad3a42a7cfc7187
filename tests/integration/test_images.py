"""The container images in deploy/docker/: what they install, and (where a Docker engine answers) built and run.

The first test needs no Docker: it builds a wheel from exactly the files the Dockerfile copies,
with the same `pip` step, and checks that the wheel holds every subpackage, the configs, the
`pilotfish` command and the vLLM entry point. So a folder missing from the COPY lines fails here.

The image tests build both images and smoke-run them: `pilotfish --help` and each service's
`--help` as a non-root user; in the vLLM image, vLLM's plugin loader finds and runs the llumlet's
entry point and `--scheduler-cls`'s class resolves. They need a Docker engine (`docker info`
answers) and skip, with the reason, where none does. None runs on this project's machines or
CI's (no Docker engine is installed there), so they skip under CI=true too: this is the one
integration test allowed to, and the Dockerfiles' static checks in
tests/unit/test_deploy_manifests.py run everywhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def copied_paths(dockerfile: Path) -> list[str]:
    """The repository paths the Dockerfile's COPY lines take from the build context."""
    paths: list[str] = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            paths += line.split()[1:-1]
    return paths


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.vllm"])
def test_the_files_an_image_copies_build_the_whole_package(dockerfile: str, tmp_path: Path) -> None:
    context = tmp_path / "context"
    for path in copied_paths(DOCKER / dockerfile):
        source = ROOT / path
        if source.is_dir():
            shutil.copytree(source, context / path, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (context / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, context / path)
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(context)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = out.glob("pilotfish-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    listed = re.search(r"COMPONENTS = \[(.*?)\]", (ROOT / "setup.py").read_text(), re.S)
    assert listed
    components = re.findall(r'"([a-z_]+)"', listed[1])
    expected = {"pilotfish"} | {
        "pilotfish/" + init.parent.relative_to(ROOT).as_posix()
        for folder in components
        for init in (ROOT / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert len(expected) > len(components)  # the subpackages too (scheduler/policy/..., discovery/backends, ...)
    assert expected <= packages, f"missing from the image: {sorted(expected - packages)}"
    assert any(n.startswith("pilotfish/envoy/") and n.endswith(".yaml") for n in names)
    assert any(n.endswith("_pb2.py") for n in names)
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "pilotfish = pilotfish.cli:main" in entry_points
    assert "pilotfish_llumlet = pilotfish.vllm_plugin:register" in entry_points


def docker_answers() -> str | None:
    """None when a Docker engine answers; else why not."""
    if shutil.which("docker") is None:
        return "no docker client installed"
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 20 s"
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no reason given"])[-1]
        return f"no Docker engine answers `docker info`: {reason}"
    return None


@pytest.fixture(scope="module")
def docker() -> None:
    if (why := docker_answers()) is not None:
        pytest.skip(f"{why} (these machines and CI have no Docker engine; the images are built where one answers)")


def build(dockerfile: str, tag: str) -> None:
    subprocess.run(
        ["docker", "build", "-f", str(DOCKER / dockerfile), "-t", tag, str(ROOT)],
        check=True, timeout=3600,
    )  # fmt: skip


def run(image: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
    command = ["docker", "run", "--rm", "--network=none"]
    if entrypoint:
        command += ["--entrypoint", entrypoint]
    return subprocess.run([*command, image, *args], capture_output=True, text=True, timeout=300, check=False)


def test_pilotfish_image_builds_and_runs_each_service_unprivileged(docker: None) -> None:
    tag = f"pilotfish:{VERSION}"
    build("Dockerfile", tag)
    assert "scheduler" in run(tag, "--help").stdout
    for command in ("scheduler", "ext-proc", "sidecar", "rescheduler"):
        result = run(tag, command, "--help")
        assert result.returncode == 0 and "--discovery" in result.stdout + result.stderr, command
    uid = run(tag, "-u", entrypoint="id")
    assert uid.returncode == 0 and uid.stdout.strip() == "10001"


@pytest.mark.slow
def test_vllm_image_builds_and_vllm_loads_the_plugin(docker: None) -> None:
    tag = f"pilotfish-vllm:{VERSION}"
    build("Dockerfile.vllm", tag)
    code = (
        "import sys; sys.argv = ['vllm', 'serve', 'm', '--scheduler-cls', 'pilotfish.vllm_plugin.LlumletScheduler']\n"
        "import vllm.plugins as p; p.load_general_plugins()\n"
        "import pilotfish.vllm_plugin as v; print(v.LlumletScheduler.__name__)\n"
    )
    result = run(tag, "-c", code, entrypoint="python3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "LlumletScheduler"
    assert re.search(r"\d", run(tag, "-c", "import vllm; print(vllm.__version__)", entrypoint="python3").stdout)
