"""$PILOTFISH_VLLM_ARGS reaches every vLLM the tests and benchmarks start, after the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilotfish.vllm_plugin import testing


class _Started(Exception):
    pass


def _argv_of_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The argv start_vllm would run; the launch itself is cut short before any process starts."""
    seen: list[list[str]] = []

    def fake_child(name: str, argv: list[str], **_: object) -> None:
        seen.append(argv)
        raise _Started

    python = tmp_path / "python"
    python.touch()
    monkeypatch.setenv(testing.VLLM_PYTHON_ENV, str(python))
    monkeypatch.setattr(testing, "Child", fake_child)
    with pytest.raises(_Started):
        testing.start_vllm(tmp_path / "model", tmp_path / "work", extra_args=["--max-num-seqs", "8"], port=1)
    return seen[0]


def test_unset_adds_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(testing.VLLM_ARGS_ENV, raising=False)
    assert testing.vllm_args_from_env() == []
    argv = _argv_of_start(monkeypatch, tmp_path)
    assert argv[-2:] == ["--max-num-seqs", "8"]


def test_arguments_come_last_and_keep_quoted_words_together(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(testing.VLLM_ARGS_ENV, "--gpu-memory-utilization 0.2 --override-generation-config '{\"a\": 1}'")
    argv = _argv_of_start(monkeypatch, tmp_path)
    tail = ["--gpu-memory-utilization", "0.2", "--override-generation-config", '{"a": 1}']
    assert argv[-len(tail):] == tail
    # after the caller's own extra arguments, so a flag named in both takes the environment's value
    assert argv.index("--max-num-seqs") < argv.index("--gpu-memory-utilization")
