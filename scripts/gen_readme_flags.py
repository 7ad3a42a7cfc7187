#!/usr/bin/env python3
"""Fill the README's flag tables from the config structs, so docs never disagree with code.

A table sits between `<!-- flags: module:Struct -->` and `<!-- /flags -->`; everything between
the markers is regenerated. `--check` fails when the README is stale (tests/unit/test_readme.py).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"(<!-- flags: ([\w.]+):(\w+) -->\n)(.*?)(<!-- /flags -->)", re.S)


def render(text: str) -> str:
    from pilotfish.config import flag_table

    def fill(m: re.Match[str]) -> str:
        struct = getattr(importlib.import_module(m.group(2)), m.group(3))
        return f"{m.group(1)}{flag_table(struct)}\n{m.group(5)}"

    return BLOCK.sub(fill, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md is stale")
    args = parser.parse_args()
    current = README.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md flag tables are stale; run scripts/gen_readme_flags.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
