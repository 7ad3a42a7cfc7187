#!/usr/bin/env python3
"""Fill the flag tables of the READMEs and docs/ from the config structs, so docs never disagree with code.

A table sits between `<!-- flags: module:Struct -->` and `<!-- /flags -->`; everything between
the markers is regenerated. `--check` fails when the README is stale (tests/unit/test_readme.py).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the project README, every component's own README and the docs (docs/configuration.md holds the
# components' full tables)
READMES = [ROOT / "README.md", *sorted(ROOT.glob("*/README.md")), *sorted(ROOT.glob("docs/*.md"))]
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
    stale = []
    for readme in READMES:
        current = readme.read_text()
        fresh = render(current)
        if fresh != current:
            stale.append(str(readme.relative_to(ROOT)))
            if not args.check:
                readme.write_text(fresh)
    if args.check and stale:
        print(f"flag tables are stale in {', '.join(stale)}; run scripts/gen_readme_flags.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
