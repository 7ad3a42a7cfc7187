"""The README's flag tables are generated from the config structs and must be current."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_flag_tables_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_readme_flags.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_readme_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## What Pilotfish is")]
    assert "bash scripts/demo" in head and "bash scripts/test" in head
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test" in ci
