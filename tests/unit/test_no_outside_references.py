"""No file in the repository sends its reader to a document the repository does not contain.

Pilotfish's contracts are restated in docs/ in the project's own words; a sentence that points to
the design notes or the specification it was built from, or to the tracker item that asked for a
change, points somewhere a user of the repository cannot follow.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# spelled in pieces so this file does not match itself
FORBIDDEN = re.compile(
    "|".join(
        [
            r"\bthe\s+" + "spec" + r"\b",  # and its possessive; not "the specification"
            r"\b" + "DESIGN" + r"\.md\b",
            r"\bthe\s+" + "issue" + r"\b",
        ]
    ),
    re.IGNORECASE,
)


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: no list of tracked files")
    files = []
    for name in out.decode().split("\0"):
        if not name or name.startswith(".venv") or re.search(r"_pb2(_grpc)?\.pyi?$", name):
            continue
        path = ROOT / name
        if path.is_file():
            files.append(path)
    return files


def _text(path: Path) -> str | None:
    raw = path.read_bytes()
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_file_points_outside_the_repository() -> None:
    found = []
    for path in _tracked_text_files():
        text = _text(path)
        if text is None:
            continue
        for m in FORBIDDEN.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert not found, "say it in the repository's own words (docs/), not by pointing outside it:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        ("as the " + "spec says", True),
        ("the " + "spec's table", True),
        ("The\n" + "Spec", True),
        ("see " + "DESIGN" + ".md", True),
        ("filed in the " + "issue", True),
        ("the " + "specification of the engine", False),
        ("a policy spec from the flags", False),
        ("tissue", False),
    ],
)
def test_the_patterns(text: str, flagged: bool) -> None:
    assert bool(FORBIDDEN.search(text)) is flagged
