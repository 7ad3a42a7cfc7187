"""Prompt token counting from a local file, from an installed package, or by estimate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pilotfish.ext_proc.tokens import tokenizer
from pilotfish.simulator.tokens import fallback_token_ids


def train_tokenizer(folder: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 3,
                                  trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer


def test_local_file_and_folder(tmp_path: Path) -> None:
    train_tokenizer(tmp_path / "tok")
    for given in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        assert len(tokenizer(str(given))("the quick brown fox")) == 4


def test_tokenizer_shipped_in_an_installed_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "site" / "shipped_tok"
    (package / "assets").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    train_tokenizer(package / "assets")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert len(tokenizer(tokenizer_name="shipped_tok")("lazy dog jumps")) == 3
    assert len(tokenizer(tokenizer_name="shipped_tok:assets/tokenizer.json")("lazy dog")) == 2
    sys.modules.pop("shipped_tok", None)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tokenizer_name": "no_such_package_xyz"}, "no installed package"),
        ({"tokenizer_name": "json"}, "ships no tokenizer.json"),
        ({"tokenizer_path": "/nonexistent"}, "no tokenizer.json"),
        ({"tokenizer_path": "/a", "tokenizer_name": "b"}, "not both"),
    ],
)
def test_bad_tokenizer_settings_name_the_problem(kwargs, fragment) -> None:
    with pytest.raises(FileNotFoundError, match=fragment):
        tokenizer(**kwargs)


def test_without_a_tokenizer_the_simulators_fallback_is_used() -> None:
    assert tokenizer() is fallback_token_ids
    assert len(tokenizer()("the quick brown fox.")) == 5
