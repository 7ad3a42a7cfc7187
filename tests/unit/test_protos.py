"""The checked-in generated code must match the .proto files."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test dependency (pip install -e .[test])")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_records_round_trip() -> None:
    from pilotfish.protos import cms_pb2, scheduler_pb2

    status = cms_pb2.InstanceStatus(instance_id="e0", update_id=7, admitted_request_ids=["a", "b"])
    assert cms_pb2.InstanceStatus.FromString(status.SerializeToString()) == status
    req = scheduler_pb2.ScheduleRequest(request_id="r", prefix_block_hashes=[2**64 - 1])
    assert scheduler_pb2.ScheduleRequest.FromString(req.SerializeToString()).prefix_block_hashes == [2**64 - 1]
