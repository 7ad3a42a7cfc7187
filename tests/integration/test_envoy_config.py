"""The real Envoy binary accepts the rendered sidecar bootstrap."""

import subprocess
from pathlib import Path

import pytest

from pilotfish.envoy_bootstrap import render_sidecar, write_eds
from pilotfish.procs import free_port, wait_until
from pilotfish.services import http_call, start_envoy

pytestmark = pytest.mark.integration


def test_envoy_validates_the_sidecar_bootstrap(envoy_binary: Path, tmp_path: Path) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text(
        render_sidecar(listen_port=18080, admin_port=19901, ext_proc_ports=[50061, 50062],
                       default_endpoints=[("127.0.0.1", 8001), ("127.0.0.1", 8002)])
    )
    proc = subprocess.run(
        [str(envoy_binary), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "OK" in proc.stdout + proc.stderr


@pytest.mark.parametrize("eds", [False, True], ids=["static-pool", "eds-file"])
def test_envoy_validates_the_sidecar_bootstrap_with_retries_down_the_pickers_list(
    envoy_binary: Path, tmp_path: Path, eds: bool
) -> None:
    engines = [("127.0.0.1", 8001), ("127.0.0.1", 8002)]
    eds_path = tmp_path / "pool.json" if eds else ""
    if eds_path:
        write_eds(eds_path, engines)
    config = tmp_path / "sidecar.yaml"
    config.write_text(
        render_sidecar(listen_port=18080, admin_port=19901, ext_proc_ports=[50061], default_endpoints=engines,
                       destination_fallbacks=1, eds_path=eds_path, request_body_mode="FULL_DUPLEX_STREAMED",
                       response_body_mode="FULL_DUPLEX_STREAMED")
    )  # fmt: skip
    proc = subprocess.run(
        [str(envoy_binary), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_rewritten_eds_file_reaches_envoys_retry_pool(envoy_binary: Path, tmp_path: Path) -> None:
    """Discovery changes reach Envoy: write_eds swaps the file, Envoy swaps the members."""
    eds_path = tmp_path / "pool.json"
    write_eds(eds_path, [("127.0.0.1", 18101)])
    bootstrap = render_sidecar(
        listen_port=free_port(), admin_port=0, ext_proc_ports=[free_port()],
        default_endpoints=[("127.0.0.1", 18101)], destination_fallbacks=1, eds_path=eds_path,
    )  # fmt: skip
    envoy = start_envoy(bootstrap, tmp_path)
    try:

        def members() -> set[str]:
            status, body = http_call(f"{envoy.url}/clusters")
            assert status == 200
            return {line.split("::")[1] for line in body.decode().splitlines() if line.startswith("picked_pool::1")}

        wait_until(lambda: members() == {"127.0.0.1:18101"}, 30, "the first member")
        write_eds(eds_path, [("127.0.0.1", 18101), ("127.0.0.1", 18102)])
        wait_until(lambda: members() == {"127.0.0.1:18101", "127.0.0.1:18102"}, 30, "the added member")
        write_eds(eds_path, [("127.0.0.1", 18102)])
        wait_until(lambda: members() == {"127.0.0.1:18102"}, 30, "the removed member gone")
    finally:
        envoy.stop()
