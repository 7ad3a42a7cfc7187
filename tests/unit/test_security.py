"""pilotfish/security.py: the shared flags, the refusal beyond loopback, the token, the Session auth
frame, Redis options and the certificate files' reload (no servers here: see
tests/integration/test_control_plane_tls.py)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest

from pilotfish.config import ConfigError, add_struct_arguments, struct_from_args
from pilotfish.discovery.config import SidecarConfig
from pilotfish.ext_proc.config import ExtProcConfig
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.security import SESSION_AUTH_PREFIX, Security, SecurityConfig, _ServerFiles, is_loopback
from pilotfish.vllm_plugin.config import LlumletConfig, config_from_env, llumlet_security

FLAGS = ["--tls-cert-file", "--tls-key-file", "--tls-ca-file", "--tls-server-name", "--auth-token-file",
         "--redis-password-file", "--insecure"]  # fmt: skip


@pytest.mark.parametrize("struct", [SchedulerConfig, ExtProcConfig, SidecarConfig])
def test_every_component_takes_the_same_flags(struct: type, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_struct_arguments(parser, struct)
    known = {a for action in parser._actions for a in action.option_strings}
    assert set(FLAGS) <= known
    args = parser.parse_args(["--auth-token-file", str(tmp_path / "t"), "--insecure"])
    config = struct_from_args(struct, args)
    assert isinstance(config, SecurityConfig) and config.insecure and config.auth_token_file


def test_the_llumlet_takes_them_as_environment_variables(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    config = config_from_env({"PILOTFISH_AUTH_TOKEN_FILE": str(token), "PILOTFISH_INSECURE": "true"})
    assert isinstance(config, SecurityConfig) and config.insecure
    assert llumlet_security(config).token == b"abc"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.1", False), ("scheduler.internal", False)],
)  # fmt: skip
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_beyond_loopback_needs_tls_or_a_token(caplog: pytest.LogCaptureFixture) -> None:
    Security().check_listener("127.0.0.1")  # plaintext on loopback: fine
    with pytest.raises(ConfigError) as info:
        Security().check_listener("0.0.0.0", "--host")
    assert str(info.value) == (
        "--host: 0.0.0.0 is beyond loopback; set --tls-cert-file and --tls-key-file, or --auth-token-file "
        "(or --insecure to serve it without either)"
    )
    Security(token=b"t").check_listener("0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="pilotfish.security"):
        Security(insecure=True).check_listener("0.0.0.0", "--host")
    assert any("--insecure" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("given", "ok"),
    [("Bearer s3cret", True), (b"Bearer s3cret", True), ("Bearer s3cre", False), ("s3cret", False),
     ("Bearer s3cret ", False), ("", False), (None, False)],
)  # fmt: skip
def test_token_compare(given: str | bytes | None, ok: bool) -> None:
    assert Security(token=b"s3cret").token_ok(given) is ok
    assert Security().token_ok(given) is True  # no token configured: nothing to check


@pytest.mark.parametrize(
    ("server_token", "first", "verdict"),
    [
        (b"tok", SESSION_AUTH_PREFIX + b"tok", True),
        (b"tok", SESSION_AUTH_PREFIX + b"bad", False),
        (b"tok", b"\x08\x01", False),  # a Session message before the token
        (b"", b"\x08\x01", None),  # no token needed: it is a message
        (b"", SESSION_AUTH_PREFIX + b"any", True),  # a client with a token, a server without: consumed
    ],
)
def test_session_first_frame(server_token: bytes, first: bytes, verdict: bool | None) -> None:
    assert Security(token=server_token).check_session_auth(first) is verdict


def test_files_name_their_flag(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"^--auth-token-file: cannot read"):
        Security.from_config(SecurityConfig(auth_token_file=missing), {})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"^--auth-token-file: .* is empty"):
        Security.from_config(SecurityConfig(auth_token_file=str(empty)), {})
    with pytest.raises(ConfigError, match=r"^--tls-key-file: --tls-cert-file and --tls-key-file go together"):
        Security.from_config(SecurityConfig(tls_cert_file=missing), {})
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"^--tls-cert-file/--tls-key-file"):
        Security.from_config(SecurityConfig(tls_cert_file=str(garbage), tls_key_file=str(garbage)), {})


def test_unset_fields_fall_back_to_the_environment(tmp_path: Path) -> None:
    token, password = tmp_path / "token", tmp_path / "pw"
    token.write_text("from-env\n")
    password.write_text("pw1\n")
    env = {"PILOTFISH_AUTH_TOKEN_FILE": str(token), "PILOTFISH_REDIS_PASSWORD_FILE": str(password)}
    security = Security.from_config(SchedulerConfig(), env)
    assert security.token == b"from-env" and security.redis_password == "pw1"
    other = tmp_path / "other"
    other.write_text("from-flag\n")
    assert Security.from_config(SchedulerConfig(auth_token_file=str(other)), env).token == b"from-flag"


def test_the_older_llumlet_token_is_the_same_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    assert llumlet_security(LlumletConfig(llumlet_token="abc")).token == b"abc"
    assert llumlet_security(LlumletConfig(llumlet_token="abc", auth_token_file=str(token))).token == b"abc"
    with pytest.raises(ConfigError, match="PILOTFISH_AUTH_TOKEN_FILE: differs from PILOTFISH_LLUMLET_TOKEN"):
        llumlet_security(LlumletConfig(llumlet_token="xyz", auth_token_file=str(token)))


def test_redis_options(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("read when dialling")
    security = Security(redis_password="pw", ca=str(ca))
    assert security.redis_options("redis://127.0.0.1:6379/0") == {"password": "pw"}
    assert security.redis_options("redis://:inurl@127.0.0.1:6379/0") == {}  # the URL's own wins
    assert security.redis_options("rediss://cms:6380/0") == {"password": "pw", "ssl_ca_certs": str(ca)}
    assert Security().redis_options("redis://127.0.0.1:6379/0") == {}


def test_certificate_files_reload_only_when_they_change_and_load(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from pilotfish.security_testing import issue, make_ca

    ca_key, ca_cert, ca = make_ca(tmp_path)
    cert, key = issue(ca_key, ca_cert, tmp_path, "a")
    files = _ServerFiles(str(cert), str(key), str(ca))
    first = files.pem
    assert files.refresh() is False and files.generation == 0
    new_cert, new_key = issue(ca_key, ca_cert, tmp_path, "b")
    os.replace(new_cert, cert)  # the certificate before its key: the pair does not load yet
    assert files.refresh() is False and files.pem == first
    os.replace(new_key, key)
    assert files.refresh() is True and files.generation == 1 and files.pem != first
    assert files.refresh() is False
