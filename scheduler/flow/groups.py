"""Flow keys with a group: fair shares are split between groups first, then between a group's flows.

A flow is the gateway's hash of a tenant header, and whoever sets the header chooses it: a client that
keeps many tenant ids alive would get a share (and a queue turn) per id. The gateway can prefix the key
with something the client cannot mint at will, the group: by default the hash of the client's address
as Envoy saw the connection (ext_proc/flow.py). The key is then `<group>:<flow>`. Flow control judges
the groups against each other as it judges flows (a group over 1/active groups of the work, and asking
for more than that, has every flow of it over its share), and the flows of each group against each
other the same way; the queue's turns go round the groups, and within a group round its flows. So
however many ids one client keeps alive, they share its address's one share.

A key without the separator is in the empty group. Where every flow is in one group, or each in its
own, the judgements and turns are exactly those of flows counted alone.
"""

from __future__ import annotations

from collections.abc import Iterable

SEPARATOR = ":"  # not a hex digit: the gateway's hashes never hold it


def group_of(flow: str) -> str:
    """The group of a flow key ("" when the gateway sent none)."""
    head, sep, _ = flow.partition(SEPARATOR)
    return head if sep else ""


def joined(group: str, flow: str) -> str:
    """The key of `flow` in `group` (`flow` itself in the empty group)."""
    return f"{group}{SEPARATOR}{flow}" if group else flow


def by_group(flows: Iterable[str]) -> dict[str, list[str]]:
    """The flows of each group, in the order given."""
    members: dict[str, list[str]] = {}
    for f in flows:
        members.setdefault(group_of(f), []).append(f)
    return members
