"""Hostile or broken CMS records are refused with a reason, never a crash."""

import pytest

from pilotfish.cms import keys
from pilotfish.cms.records import MAX_RECORD_BYTES, BadRecord, decode_metadata, decode_status, is_newer
from pilotfish.protos import cms_pb2


def status(**kw) -> cms_pb2.InstanceStatus:
    return cms_pb2.InstanceStatus(**{"instance_id": "e0", "update_id": 1, **kw})


def test_valid_status_round_trips():
    s = status(num_waiting=3, admitted_request_ids=["a"])
    assert decode_status(s.SerializeToString(), "e0") == s


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"\xff" * 10, "not a valid protobuf"),
        (b"x" * (MAX_RECORD_BYTES + 1), "exceeds"),
        (status(instance_id="").SerializeToString(), "instance_id"),
        (status(instance_id="a:b").SerializeToString(), "instance_id"),
        (status(instance_id="other").SerializeToString(), "names instance"),
        (status(admitted_request_ids=["r"] * 5000).SerializeToString(), "admitted ids"),
        (status(used_kv_tokens=10, total_kv_tokens=5).SerializeToString(), "KV tokens"),
    ],
)
def test_bad_status_is_refused(raw, fragment):
    with pytest.raises(BadRecord, match=fragment):
        decode_status(raw, "e0")


@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        (cms_pb2.InstanceMetadata(instance_id="e0", host="", http_port=80), "usable address"),
        (cms_pb2.InstanceMetadata(instance_id="e0", host="h", http_port=0), "usable address"),
        (cms_pb2.InstanceMetadata(instance_id="e 0", host="h", http_port=80), "instance_id"),
    ],
)
def test_bad_metadata_is_refused(meta, fragment):
    with pytest.raises(BadRecord, match=fragment):
        decode_metadata(meta.SerializeToString())


def test_only_newer_updates_win():
    assert is_newer(status(update_id=2), status(update_id=1))
    assert not is_newer(status(update_id=1), status(update_id=1))
    assert is_newer(status(update_id=1), None)


def test_key_layout():
    assert keys.status_key("c", "e0") == "pilotfish:c:status:e0"
    assert keys.instance_of(b"pilotfish:c:meta:e0") == "e0"
    with pytest.raises(keys.BadId):
        keys.check_id("x" * 201, "id")
