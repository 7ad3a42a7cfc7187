"""Which flow ids fair shares count apart: a client that sends a new tenant id with every request must
not get a share per id.

A flow is the gateway's hash of a tenant header (ext_proc/flow.py), and whoever sets the header chooses
it. Counted as given, ids used once cost the fair share twice over: the queue's round robin gives every
id a turn, so a client rotating ids takes nearly every turn; and each of its ids holds one request,
under 1/active of the work, so the tenants that send many requests look over their share and are the
ones held back.

So an id counts as its own flow only once it is established: seen again at least `after_s` seconds after
it was first seen (and still remembered then). Until then its requests go to one shared flow,
NEWCOMERS, which holds one share and one turn like any tenant (one per group, groups.py: a key
`<group>:<id>` not yet established counts in `<group>:~newcomers`). A client that rotates ids stays
there whatever it sends; a tenant that keeps sending is established after its first `after_s` seconds.
A client that keeps many ids alive (each used again after `after_s`) gets a flow per id, but within
its group: the gateway groups by the client's address, so they share that address's one share.

Both tables are bounded least-recently-used maps. Ids used once can flush the table of candidates (a
new tenant then takes longer to be established), never the established ones, which leave only when
established ids that were used more lately push them out.
"""

from __future__ import annotations

from collections import OrderedDict

from pilotfish.scheduler.flow.groups import SEPARATOR, group_of, joined

# the shared flow of ids not yet established; not a hash the gateway sends (those are 16 hex digits),
# and a gateway that sends it anyway only joins the newcomers
NEWCOMERS = "~newcomers"
MAX_CANDIDATES = 16384
MAX_ESTABLISHED = 4096


class Newcomers:
    def __init__(
        self, after_s: float, max_candidates: int = MAX_CANDIDATES, max_established: int = MAX_ESTABLISHED
    ) -> None:
        """`after_s`: how long after its first request an id's next one establishes it; 0 counts every id
        as its own flow at once (no folding)."""
        self.after_s = after_s
        self.max_candidates = max_candidates
        self.max_established = max_established
        self._candidates: OrderedDict[str, float] = OrderedDict()  # id -> first seen
        self._established: OrderedDict[str, None] = OrderedDict()  # least recently seen first
        self.folded = 0  # requests counted in NEWCOMERS

    def __len__(self) -> int:
        """Established ids."""
        return len(self._established)

    def establish(self, flow_id: str) -> None:
        """Count `flow_id` as its own flow from now on (a tenant known before, as the benchmarks' are)."""
        self._candidates.pop(flow_id, None)
        self._established[flow_id] = None
        self._established.move_to_end(flow_id)
        if len(self._established) > self.max_established:
            self._established.popitem(last=False)

    def flow(self, flow_id: str, now: float) -> str:
        """The flow `flow_id`'s request at `now` counts in: itself once established, else NEWCOMERS (its
        group's). "" (no header: the default flow) is always itself, as is a group's default `<group>:`."""
        if not flow_id or self.after_s <= 0 or flow_id.endswith(SEPARATOR):
            return flow_id
        established = self._established
        if flow_id in established:
            established.move_to_end(flow_id)
            return flow_id
        candidates = self._candidates
        first = candidates.get(flow_id)
        if first is None:
            candidates[flow_id] = now
            if len(candidates) > self.max_candidates:
                candidates.popitem(last=False)
        elif now - first >= self.after_s:
            self.establish(flow_id)
            return flow_id
        else:  # a tenant that keeps sending outlives ids used once in the table
            candidates.move_to_end(flow_id)
        self.folded += 1
        return joined(group_of(flow_id), NEWCOMERS)
