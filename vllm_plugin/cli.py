"""`pilotfish llumlet ...`: look at what llumlets export and talk to one, for operators.

The llumlet itself starts inside vLLM (see vllm_plugin/README.md), not from this command.

    pilotfish llumlet show --cms-url redis://h:6379/0 --cluster prod    every instance in the CMS
    pilotfish llumlet status --address 127.0.0.1:PORT [--token T]       one llumlet's live status
    pilotfish llumlet abort --address 127.0.0.1:PORT ID [ID ...]        abort requests on it
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("llumlet", help="inspect the CMS and talk to a llumlet (the vLLM plugin)")
    sub = parser.add_subparsers(dest="llumlet_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="every instance's metadata and status in the CMS, as JSON lines")
    show.add_argument("--cms-url", required=True, help="Redis URL of the CMS")
    show.add_argument("--cluster", default="default", help="cluster name (default: default)")
    show.set_defaults(run=_show)
    for name, helptext in (("status", "one llumlet's current status (GetStatus)"), ("abort", "abort requests")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--address", required=True, help="the llumlet's gRPC address, host:port (in its metadata)")
        p.add_argument("--token", default="", help="bearer token, if the llumlet requires one")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
        if name == "abort":
            p.add_argument("request_ids", nargs="+", metavar="ID", help="request ids as the status lists them")
        p.set_defaults(run=_call)


def _to_json(message: Any) -> str:
    from google.protobuf.json_format import MessageToDict

    return json.dumps(MessageToDict(message, preserving_proto_field_name=True), sort_keys=True)


def _show(args: argparse.Namespace) -> int:
    import redis

    from pilotfish.cms import keys
    from pilotfish.cms.records import BadRecord, decode_metadata, decode_status

    client = redis.Redis.from_url(args.cms_url, socket_timeout=5)
    for kind, pattern, decode in (
        ("meta", keys.meta_pattern(args.cluster), decode_metadata),
        ("status", keys.status_pattern(args.cluster), decode_status),
    ):
        for key in sorted(client.scan_iter(match=pattern, count=1000)):
            raw = client.get(key)
            if raw is None:
                continue
            instance = keys.instance_of(key)
            line: dict[str, Any] = {"kind": kind, "instance": instance}
            try:
                line["record"] = json.loads(_to_json(decode(raw, instance)))
            except BadRecord as exc:
                line["rejected"] = str(exc)
            print(json.dumps(line))
    return 0


def _call(args: argparse.Namespace) -> int:
    import grpc

    from pilotfish.protos import llumlet_pb2, llumlet_pb2_grpc

    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    with grpc.insecure_channel(args.address) as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        try:
            if args.llumlet_command == "status":
                reply: Any = stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=args.timeout, metadata=metadata)
            else:
                request = llumlet_pb2.AbortRequest(request_ids=args.request_ids)
                reply = stub.Abort(request, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"pilotfish llumlet {args.llumlet_command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(_to_json(reply))
    return 0
