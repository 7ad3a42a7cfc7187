"""Replay the slow-frame attack on the scheduler's Session socket and print its memory cost.

    .venv/bin/python scripts/session_frame_attack.py [--connections 20] [--frame-bytes 4194304]
        [--tree DIR] [-- extra scheduler flags]

Starts `pilotfish scheduler` (lite mode, one static engine, a Session socket) as a child, reads
its RSS, then opens N connections that each send a frame header announcing `--frame-bytes` and
all of the frame but its last byte, and hold it. It prints the scheduler's RSS before and after
(the most it reached while the RSS settles), how many connections the scheduler closed, and,
with `--wait-close S`, how many it closed within S seconds (idle and frame timeouts).

`--tree DIR` runs the scheduler from another checkout (e.g. `git archive HEAD~3 | tar -x -C DIR`),
to measure the code before a change on the same machine. A measurement, not a test: it reads the
clock and the kernel's RSS, which no test should assert on.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HELLO = b"pilotfish-session/1\n"
COMPONENTS = ("bench", "cms", "discovery", "ext_proc", "protos", "scheduler", "simulator", "vllm_plugin")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shadow_tree(tree: Path) -> Path:
    """A directory whose `pilotfish` package is `tree`'s, laid out as setup.py installs it, found
    before the editable install of this checkout."""
    root = Path(tempfile.mkdtemp(prefix="pf-shadow-"))
    pkg = root / "pilotfish"
    pkg.mkdir()
    for item in (tree / "pilotfish").iterdir():
        (pkg / item.name).symlink_to(item)
    for name in COMPONENTS:
        (pkg / name).symlink_to(tree / name)
    (pkg / "envoy").symlink_to(tree / "envoy")
    return root


def settle(pid: int, limit_s: float = 15.0) -> int:
    """The RSS once four readings 0.25 s apart agree within 1 MiB (or at the limit): the peak seen."""
    peak, last, same = 0, -1, 0
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and same < 4:
        now = rss_kib(pid)
        peak = max(peak, now)
        same = same + 1 if abs(now - last) < 1024 else 0
        last = now
        time.sleep(0.25)
    return peak


def is_closed(sock: socket.socket) -> bool:
    """Whether the scheduler closed it (its HELLO, if any, is read and dropped)."""
    while True:
        try:
            data = sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        if not data:
            return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--frame-bytes", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--tree", type=Path, help="run the scheduler from this checkout")
    parser.add_argument("--wait-close", type=float, default=0.0, help="then wait this long for closes")
    parser.add_argument("extra", nargs="*", help="more scheduler flags (after --)")
    args = parser.parse_args()

    port, session_port = free_port(), free_port()
    env = dict(os.environ)
    if args.tree:
        env["PYTHONPATH"] = str(shadow_tree(args.tree.resolve()))
    command = [sys.executable, "-m", "pilotfish", "scheduler", "--instances", "127.0.0.1:8001", "--model", "m",
               "--port", str(port), "--session-port", str(session_port), *args.extra]  # fmt: skip
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if "listening" not in line:
            raise SystemExit(f"the scheduler did not start: {line!r}")
        base = settle(child.pid)
        socks: list[socket.socket] = []
        refused = 0

        def attack(sock: socket.socket) -> None:
            nonlocal refused
            try:
                sock.sendall(struct.pack("!I", args.frame_bytes) + b"\0" * (args.frame_bytes - 1))
            except OSError:
                refused += 1

        threads = []
        for _ in range(args.connections):
            sock = socket.create_connection(("127.0.0.1", session_port))
            socks.append(sock)
            t = threading.Thread(target=attack, args=(sock,), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(timeout=30)
        peak = settle(child.pid)
        closed = sum(is_closed(s) for s in socks)
        print(f"scheduler RSS before: {base / 1024:.1f} MiB")
        print(f"scheduler RSS with {args.connections} connections each holding {args.frame_bytes - 1} bytes of a "
              f"{args.frame_bytes}-byte frame: {peak / 1024:.1f} MiB (+{(peak - base) / 1024:.1f} MiB)")  # fmt: skip
        print(f"connections the scheduler closed at once: {closed} of {args.connections} "
              f"({refused} saw the close while sending)")  # fmt: skip
        if args.wait_close:
            deadline = time.monotonic() + args.wait_close
            while time.monotonic() < deadline and not all(is_closed(s) for s in socks):
                time.sleep(0.1)
            print(f"closed within {args.wait_close:g} s: {sum(is_closed(s) for s in socks)} of {args.connections}; "
                  f"RSS then {rss_kib(child.pid) / 1024:.1f} MiB")  # fmt: skip
        for s in socks:
            s.close()
    finally:
        child.terminate()
        child.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
