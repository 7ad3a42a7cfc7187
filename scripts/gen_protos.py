#!/usr/bin/env python3
"""Generate Python code for protos/*.proto with grpcio-tools; the output is checked in.

The .proto files import each other as "pilotfish/protos/x.proto", so they are staged under
that path and the generated modules import `pilotfish.protos.x_pb2`, which is where they
are installed. `--check` regenerates into a temporary folder and fails if anything differs
(tests/unit/test_protos.py runs it, so stale generated code fails CI).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTOS = Path(__file__).resolve().parent.parent / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as stage:
        stage_path = Path(stage)
        package = stage_path / "pilotfish" / "protos"
        package.mkdir(parents=True)
        sources = sorted(PROTOS.glob("*.proto"))
        for source in sources:
            shutil.copy(source, package / source.name)
        args = [
            "protoc",
            f"-I{stage_path}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={stage_path}",
            f"--pyi_out={stage_path}",
            f"--grpc_python_out={stage_path}",
            *(f"pilotfish/protos/{s.name}" for s in sources),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for generated in sorted(package.iterdir()):
            if generated.name.endswith(GENERATED_SUFFIXES):
                target = out_dir / generated.name
                shutil.copy(generated, target)
                written.append(target)
        return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the checked-in code is stale")
    args = parser.parse_args()
    if not args.check:
        for path in generate(PROTOS):
            print(f"wrote {path.relative_to(PROTOS.parent)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    current = {p.name: p.read_bytes() for p in PROTOS.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
    stale = sorted(n for n in fresh.keys() | current.keys() if fresh.get(n) != current.get(n))
    if stale:
        print(f"generated code is stale: {', '.join(stale)}; run scripts/gen_protos.py", file=sys.stderr)
        return 1
    print("generated code is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
