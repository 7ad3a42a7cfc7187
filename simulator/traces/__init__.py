"""Request traces: loaders (Mooncake-style JSONL, Azure and BurstGPT CSV; `load_trace_file` tells them
apart), a synthetic shared-prefix generator, load transforms, and the mapping from a trace's prefix
structure to token ids and prompt text."""

from pilotfish.simulator.traces.azure import load_azure
from pilotfish.simulator.traces.burstgpt import load_burstgpt
from pilotfish.simulator.traces.files import load_trace_file
from pilotfish.simulator.traces.model import Segment, Trace, TraceRequest
from pilotfish.simulator.traces.mooncake import MOONCAKE_BLOCK_TOKENS, load_mooncake
from pilotfish.simulator.traces.paths import default_trace_dir, resolve_trace
from pilotfish.simulator.traces.prompts import prompt_text, prompt_token_ids, segment_text, segment_token_ids
from pilotfish.simulator.traces.synthetic import SharedPrefixSpec, poisson_arrivals, shared_prefix_trace
from pilotfish.simulator.traces.transform import compress, loop_to, take_duration

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "Segment",
    "SharedPrefixSpec",
    "Trace",
    "TraceRequest",
    "compress",
    "default_trace_dir",
    "load_azure",
    "load_burstgpt",
    "load_mooncake",
    "load_trace_file",
    "loop_to",
    "poisson_arrivals",
    "prompt_text",
    "prompt_token_ids",
    "resolve_trace",
    "segment_text",
    "segment_token_ids",
    "shared_prefix_trace",
    "take_duration",
]
