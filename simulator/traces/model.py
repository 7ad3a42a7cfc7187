"""One trace request: when it arrives, how long its prompt and output are, and its prefix structure.

The prompt is a sequence of segments, each a key and a length. A key names a fixed stream of
tokens, so two prompts whose leading segments are equal share exactly those leading tokens, at
any engine block size. Mooncake's hash ids become one segment each (512 tokens, the last one
possibly shorter); a synthetic request is a system-prompt segment shared by its group and a
question segment of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

# (key, number of tokens): the first `length` tokens of the stream named `key`
Segment = tuple[str, int]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    arrival: float  # seconds from the start of the trace
    input_length: int  # prompt tokens, exact: the sum of the segment lengths
    output_length: int  # tokens to generate (the request runs to max_tokens)
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if sum(n for _, n in self.segments) != self.input_length:
            raise ValueError(f"request {self.request_id}: segments hold {sum(n for _, n in self.segments)} "
                             f"tokens, input_length is {self.input_length}")
        if self.input_length < 1 or self.output_length < 1:
            raise ValueError(f"request {self.request_id}: empty prompt or output")


Trace = list[TraceRequest]


def unshared_trace(rows: list[tuple[float, int, int]], namespace: str) -> Trace:
    """Requests that share nothing, from (arrival s, prompt tokens, output tokens) rows, as a trace without
    prefix data gives them: in arrival order, arrivals from the first one's, each prompt one segment of its
    own, prompt and output at least one token."""
    rows = sorted(rows)
    start = rows[0][0] if rows else 0.0
    out: Trace = []
    for i, (at, prompt, output) in enumerate(rows):
        prompt = max(1, prompt)
        segment = (f"{namespace}:{i}", prompt)
        out.append(TraceRequest(f"{namespace}-{i}", at - start, prompt, max(1, output), (segment,)))
    return out
