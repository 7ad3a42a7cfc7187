"""The real Envoy binary accepts the rendered sidecar bootstrap."""

import subprocess
from pathlib import Path

import pytest

from pilotfish.envoy_bootstrap import render_sidecar

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
