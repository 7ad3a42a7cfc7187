"""Every scheduler setting and its default, once; flags, YAML keys and the README table derive from it."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.cms.keys import BadId, check_id
from pilotfish.cms.prefix_hash import DEFAULT_BLOCK_SIZE as _GATEWAY_PREFIX_BLOCK_SIZE
from pilotfish.config import ConfigError
from pilotfish.discovery.config import DiscoveryConfig


class SchedulerConfig(DiscoveryConfig, kw_only=True, forbid_unknown_fields=True):
    """Lite mode's instances come from --instances and, when it names a backend, --discovery (watched
    live); full mode's come from the CMS."""

    scheduling_policy: Annotated[
        str,
        Meta(
            description="predicted-latency (the default: least predicted TTFT plus the decode batch's "
            "stall past what its answers absorb (at least a fifth of it), then TPOT, with cache affinity within that "
            "band), load-balance, "
            "slo, round-robin (a baseline), or the name of a policy composed under `policies` in the YAML file"
        ),
    ] = "predicted-latency"
    enable_full_mode_scheduling: Annotated[
        bool,
        Meta(
            description="full mode: the cluster view comes from the llumlets' CMS records in Redis "
            "(--redis-url), with the in-flight account and forward prediction; off = lite mode (LRS, "
            "--instances). Off by default, so the stack runs without Redis"
        ),
    ] = False
    dispatch_load_metric: Annotated[
        str, Meta(description="lite mode: the load metric load-balance ranks by (num_requests or num_tokens)")
    ] = "num_requests"
    dispatch_load_threshold: Annotated[
        float | None,
        Meta(
            description="lite mode: block instances whose load metric exceeds this; "
            "if all are blocked the fallback pass ignores it (unset = no threshold)"
        ),
    ] = None
    dispatch_neutral_load_metric: Annotated[str, Meta(description="full mode: load metric for neutral instances")] = (
        "all_prefills_tokens_num"
    )
    dispatch_prefill_load_metric: Annotated[
        str, Meta(description="full mode: load metric for prefill instances (PD disaggregation)")
    ] = "all_prefills_tokens_num"
    dispatch_decode_load_metric: Annotated[
        str, Meta(description="full mode: load metric for decode instances (PD disaggregation)")
    ] = "kv_cache_usage_ratio_projected"
    dispatch_neutral_load_threshold: Annotated[
        float | None, Meta(description="full mode: threshold on the neutral load metric (unset = none)")
    ] = None
    dispatch_prefill_load_threshold: Annotated[
        float | None, Meta(description="full mode: threshold on the prefill load metric (unset = none)")
    ] = None
    dispatch_decode_load_threshold: Annotated[
        float | None, Meta(description="full mode: threshold on the decode load metric (unset = none)")
    ] = None
    dispatch_top_k: Annotated[
        int, Meta(ge=1, description="pick at random among the K least-loaded instances (1 = always the least)")
    ] = 1
    fallback_count: Annotated[
        int, Meta(ge=0, description="next-best instances returned after the target, for the gateway's retries")
    ] = 2
    enable_cache_aware_scheduling: Annotated[
        bool,
        Meta(
            description="load-balance: rank by cached prefix within the load metric's balance band (prefix "
            "index fed by dispatches, and by engine KV events in full mode); lite mode can use kv_cache_hit_len "
            "only. predicted-latency always has this affinity (within its TTFT band)"
        ),
    ] = False
    cache_aware_metric: Annotated[
        str,
        Meta(description="cache-locality metric put first: kv_cache_hit_len or cache_aware_all_prefills_tokens_num"),
    ] = "kv_cache_hit_len"
    prefix_index_capacity_blocks: Annotated[
        int, Meta(ge=1, description="prefix blocks remembered per instance when its metadata gives no KV size")
    ] = 65536
    enable_kv_events: Annotated[
        bool,
        Meta(
            description="full mode with a prefix index (cache-aware scheduling): subscribe to each engine's KV "
            "events (ZMQ) that its llumlet advertises in the CMS metadata, and feed them to the prefix index"
        ),
    ] = True
    kv_events_prefix_block_size: Annotated[
        int,
        Meta(
            ge=1,
            le=4096,
            description="the gateway's --prefix-block-size: engine KV events are re-hashed into prefix blocks "
            "of this many tokens (cms/prefix_hash.py) to match the hashes the gateway sends",
        ),
    ] = _GATEWAY_PREFIX_BLOCK_SIZE
    default_max_num_batched_tokens: Annotated[
        int,
        Meta(
            ge=1,
            le=1 << 20,
            description="an engine's token budget per step (vLLM's --max-num-batched-tokens) when its CMS "
            "metadata does not say (lite mode, or an older llumlet): forward prediction of prefill progress "
            "assumes a step takes at most this many prompt tokens",
        ),
    ] = 8192
    enable_predictor_enhanced_scheduling: Annotated[
        bool,
        Meta(
            description="full mode: subtract the prefill tokens forward-predicted as computed since each "
            "status (online step-time fit) from all_prefills_tokens_num"
        ),
    ] = False
    ttft_slo: Annotated[
        float, Meta(ge=0, description="slo and predicted-latency policies: TTFT target in ms (0 = rank only)")
    ] = 0.0
    tpot_slo: Annotated[
        float, Meta(ge=0, description="slo and predicted-latency policies: TPOT target in ms (0 = rank only)")
    ] = 0.0
    ttft_slo_dispatch_threshold: Annotated[
        float, Meta(gt=0, description="slo, predicted-latency: block instances predicted above ttft-slo x this")
    ] = 1.0
    tpot_slo_dispatch_threshold: Annotated[
        float, Meta(gt=0, description="slo, predicted-latency: block instances predicted above tpot-slo x this")
    ] = 1.0
    latency_profile: Annotated[
        str,
        Meta(
            description="YAML latency profile: step-time prior and TTFT/TPOT tables "
            "(empty = built-in Llama-3-8B/A100 figures; see scheduler/view/profile.py)"
        ),
    ] = ""
    step_time_prior_weight: Annotated[
        float, Meta(gt=0, description="how many observed steps the profile's step-time prior is worth")
    ] = 2.0
    slow_engine_ratio: Annotated[
        float,
        Meta(
            ge=0,
            le=1000,
            description="full mode: an engine whose steps take this many times what the profile says, against "
            "the fleet's fast engines, has its predicted latencies scaled by that ratio; 0: off",
        ),
    ] = 1.5
    slow_engine_ratio_lite: Annotated[
        float,
        Meta(
            ge=0,
            le=1000,
            description="lite mode: the same, judged by each engine's first tokens against the TTFT the profile "
            "predicted at dispatch; 0 (the default): off, since lite's view mispredicts TTFT by up to 3x on "
            "alike engines (cache misses it cannot see)",
        ),
    ] = 0.0
    instance_staleness_seconds: Annotated[
        float,
        Meta(
            gt=0,
            description="full mode: an instance whose status is older than this is blocked and failed over",
        ),
    ] = 10.0
    failover_domain: Annotated[
        str, Meta(description="what an unhealthy instance takes down with it: instance, node, instance-unit, node-unit")
    ] = "instance"
    redis_url: Annotated[str, Meta(description="full mode: the CMS Redis, redis://host:port/db")] = ""
    cms_cluster: Annotated[
        str, Meta(description="full mode: cluster name in the CMS keys (pilotfish:<cluster>:...)")
    ] = "default"
    cms_poll_interval_seconds: Annotated[
        float, Meta(gt=0, description="full mode: full CMS re-read period, the fallback for lost change notices")
    ] = 2.0
    cms_notice_records: Annotated[
        bool,
        Meta(
            description="full mode: take a status from the change notice that carries it on its own "
            "instance's channel (no Redis read per engine step; a record on the shared channel or about "
            "another instance is never taken); false: every notice only says which key to read. Per-llumlet "
            "Redis ACLs confine notices too when they grant each llumlet only its own channel; see "
            "docs/cms-trust.md"
        ),
    ] = True
    cms_max_clock_skew_seconds: Annotated[
        float,
        Meta(
            gt=0,
            description="full mode: refuse a CMS status whose timestamp_ms or epoch is further than this ahead "
            "of the scheduler's clock (one forged future record would otherwise pin the instance's view)",
        ),
    ] = 5.0
    cms_max_update_id_jump: Annotated[
        int,
        Meta(
            ge=1,
            description="full mode: refuse a CMS status whose update_id is more than this ahead of the one "
            "held (same epoch) and ahead of the scheduler's clock in microseconds",
        ),
    ] = 1_000_000
    cms_instance_admission: Annotated[
        str,
        Meta(
            description="full mode: what may add an instance: cms (its CMS metadata alone), discovery (only "
            "engines --discovery lists, matched by host:port), auto (discovery when --discovery names a "
            "backend, else cms); see docs/cms-trust.md"
        ),
    ] = "auto"
    account_admission_grace_seconds: Annotated[
        float,
        Meta(
            gt=0,
            description="full mode: after a missed status (update_id gap), in-flight requests dispatched "
            "this long before are taken as admitted",
        ),
    ] = 1.0
    account_admitted_window_ms: Annotated[
        int,
        Meta(
            ge=0,
            description="full mode: how long a llumlet keeps listing an admitted id in its statuses (its "
            "--admitted-window-ms); a confirmation can be lost only across a longer gap between statuses",
        ),
    ] = 2000
    policies: Annotated[
        dict[str, Any] | str,
        Meta(
            description="YAML: policies composed from registered metrics, filters and selectors per infer "
            "type, by name (see scheduler/policy/README.md); a flag value is parsed as YAML"
        ),
    ] = msgspec.field(default_factory=dict)
    instances: Annotated[
        list[str],
        Meta(description="static discovery: engines as host:port or id=host:port (id defaults to host:port)"),
    ] = msgspec.field(default_factory=list)
    model: Annotated[
        list[str],
        Meta(description="served model names; other models get NOT_FOUND (empty = accept any model)"),
    ] = msgspec.field(default_factory=list)
    host: Annotated[str, Meta(description="address the gRPC and metrics servers listen on")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="gRPC port (0 = any free port)")] = 50051
    metrics_port: Annotated[int, Meta(ge=0, le=65535, description="Prometheus /metrics port (0 = off)")] = 0
    ui_port: Annotated[
        int, Meta(ge=0, le=65535, description="the live page: engines, load, decisions, migrations (0 = off)")
    ] = 0
    ui_host: Annotated[str, Meta(description="address the live page listens on (loopback unless told)")] = "127.0.0.1"
    session_port: Annotated[
        int,
        Meta(
            ge=0,
            le=65535,
            description="port of the Session on a plain TCP socket, the gateways' fast path "
            "(ext_proc --scheduler-session-address; 0 = off)",
        ),
    ] = 0
    request_local_account_staleness_seconds: Annotated[
        float,
        Meta(
            gt=0,
            description="drop a held request (lite) or an unconfirmed in-flight entry (full) after this "
            "long without Schedule, Report or confirmation, so a lost Release never leaks load",
        ),
    ] = 300.0
    orphan_grace_seconds: Annotated[
        float,
        Meta(
            ge=0,
            description="a gateway Session that ends with requests held (the ext_proc died, so nobody will "
            "release them): each is dropped after this long unless a report or a release reaches it first",
        ),
    ] = 5.0

    # -- engine health in the data path (scheduler/health.py) --
    outlier_consecutive_failures: Annotated[
        int,
        Meta(
            ge=0,
            description="eject an engine after this many upstream failures in a row (the gateway's Release "
            "reason UPSTREAM_ERROR: a 5xx or the engine's own 429, no connection, an empty 200 or a stream "
            "without its data: [DONE]; or a request the gateway served elsewhere); "
            "0 = never",
        ),
    ] = 3
    outlier_base_ejection_seconds: Annotated[
        float,
        Meta(
            gt=0,
            description="an engine's k-th ejection in a row lasts k times this (capped), then it is let back "
            "on probation: one trial request at a time until one is admitted, answers or succeeds; one failure "
            "ejects it again, one success forgives its ejections",
        ),
    ] = 5.0
    outlier_max_ejection_seconds: Annotated[
        float, Meta(gt=0, description="the longest one ejection lasts, however many came before")
    ] = 60.0
    health_probes: Annotated[
        str,
        Meta(
            description="probe each engine's --health-probe-path: auto (lite mode only; in full mode the "
            "llumlet's CMS status and its staleness already say liveness), on, off"
        ),
    ] = "auto"
    health_probe_path: Annotated[str, Meta(description="HTTP path probed on each engine (GET, 200 = healthy)")] = (
        "/health"
    )
    health_probe_interval_seconds: Annotated[
        float, Meta(gt=0, description="seconds between two probes of one engine")
    ] = 2.0
    health_probe_timeout_seconds: Annotated[
        float, Meta(gt=0, description="a probe not answered 200 within this fails")
    ] = 1.0
    health_probe_failures: Annotated[
        int,
        Meta(
            ge=1,
            description="probes failed in a row that eject an engine, until a probe succeeds; detection "
            "within interval x this + timeout",
        ),
    ] = 2
    health_probe_concurrency: Annotated[
        int, Meta(ge=1, le=1024, description="probes in flight at once, across all engines")
    ] = 32
    engine_stall_seconds: Annotated[
        float,
        Meta(
            ge=0,
            description="full mode: eject an engine whose statuses show requests running on it while its step "
            "count stands still this long (a hung GPU or engine loop, which the llumlet's refresh keeps looking "
            "fresh), until it steps again; 0 = never",
        ),
    ] = 30.0
    engine_admission_seconds: Annotated[
        float,
        Meta(
            ge=0,
            description="full mode: a request sent to a neutral or prefill engine that no status of it lists as "
            "admitted this long, while its statuses keep coming and it admits no request at all in that time, is "
            "unadmitted; two in a row eject the engine as upstream failures would (an HTTP server that takes "
            "requests and passes none to its engine); 0 = never",
        ),
    ] = 10.0
    engine_first_token_seconds: Annotated[
        float,
        Meta(
            ge=0,
            description="lite mode: a streamed request with no first token this long, while the gateway reports "
            "other engines' first tokens since it was sent and its engine neither gave one nor finished a "
            "request, is unanswered; two "
            "in a row eject the engine as upstream failures would (an HTTP server that takes requests and "
            "answers none while its /health answers); 0 = never",
        ),
    ] = 30.0

    # -- input bounds and listener limits (scheduler/limits.py, session_server.py; scheduler/README.md) --
    max_model_len: Annotated[
        int,
        Meta(
            ge=1,
            description="a Schedule whose prompt_tokens or max_tokens is above this is refused (INVALID_ARGUMENT); "
            "a Report counts no more generated tokens than the request's max_tokens or this less its prompt",
        ),
    ] = 1_048_576
    max_prefix_block_hashes: Annotated[
        int, Meta(ge=0, description="most prefix block hashes a Schedule may carry (beyond: INVALID_ARGUMENT)")
    ] = 65_536
    max_request_id_length: Annotated[
        int, Meta(ge=1, le=4096, description="longest request id accepted, in characters (beyond: INVALID_ARGUMENT)")
    ] = 256
    max_message_bytes: Annotated[
        int,
        Meta(
            ge=64 * 1024,
            le=4 * 1024 * 1024,
            description="largest message received, a Session socket frame or a gRPC message (a Schedule with the "
            "most prefix hashes is ~0.6 MiB, a Report batch of 10,000 streams ~0.6 MiB); a bigger frame closes "
            "the socket connection, gRPC answers RESOURCE_EXHAUSTED",
        ),
    ] = 1024 * 1024
    session_max_connections: Annotated[
        int, Meta(ge=1, description="open Session socket connections at most (one per gateway); beyond: closed at once")
    ] = 256
    session_idle_timeout_seconds: Annotated[
        float,
        Meta(gt=0, description="close a Session socket connection that sends no complete frame for this long"),
    ] = 300.0
    session_frame_timeout_seconds: Annotated[
        float, Meta(gt=0, description="close a Session socket connection whose frame stays incomplete this long")
    ] = 10.0
    session_max_buffered_bytes: Annotated[
        int,
        Meta(
            ge=64 * 1024,
            description="incomplete frames held across all Session socket connections; a connection whose "
            "frame would take the total over it is closed (bounds the memory slow senders can hold)",
        ),
    ] = 64 * 1024 * 1024
    peer_schedule_rate: Annotated[
        float,
        Meta(ge=0, description="Schedules per second per peer IP, all its connections together (0 = unlimited); "
             "beyond: RESOURCE_EXHAUSTED, which the gateway answers with 429"),
    ] = 20_000.0  # fmt: skip
    peer_report_rate: Annotated[
        float,
        Meta(ge=0, description="token reports per second per peer IP (each TokenReport of a batch counts; 0 = "
             "unlimited); beyond: a Session's dropped and counted, a unary Report RESOURCE_EXHAUSTED"),
    ] = 200_000.0  # fmt: skip
    peer_release_rate: Annotated[
        float,
        Meta(ge=0, description="Releases per second per peer IP (0 = unlimited); beyond: a Session's dropped and "
             "counted, a unary Release RESOURCE_EXHAUSTED"),
    ] = 20_000.0  # fmt: skip
    peer_rate_burst_seconds: Annotated[
        float, Meta(gt=0, description="each per-peer rate's bucket holds this many seconds of it (the burst)")
    ] = 2.0
    grpc_max_concurrent_streams: Annotated[
        int, Meta(ge=1, description="gRPC: concurrent calls per connection (HTTP/2 max_concurrent_streams)")
    ] = 1000
    grpc_max_connections: Annotated[
        int,
        Meta(ge=0, description="gRPC: open connections at most (grpc.max_allowed_incoming_connections; 0 = no cap)"),
    ] = 1024
    grpc_max_connection_idle_seconds: Annotated[
        float,
        Meta(gt=0, description="gRPC: close a connection with no call for this long (its client reconnects as needed)"),
    ] = 600.0
    grpc_keepalive_seconds: Annotated[
        float,
        Meta(gt=0, description="gRPC: ping a connection quiet this long; one that does not answer in 20 s is closed"),
    ] = 60.0

    # -- rescheduling: the rescheduler's settings, checked by rescheduler/settings.py (scheduler/README.md) --
    enable_rescheduling: Annotated[
        bool,
        Meta(description="run the rescheduler: plan migrations from the CMS view and ask the llumlets to migrate"),
    ] = False
    rescheduling_policies: Annotated[
        list[str],
        Meta(
            description="rescheduling policies, run in this order (earlier ones win a conflict): decode_load, "
            "neutral_load, prefill_failover, decode_failover, neutral_failover, binpacking_mitigation, "
            "binpacking_consolidation"
        ),
    ] = msgspec.field(
        default_factory=lambda: [
            "prefill_failover",
            "decode_failover",
            "neutral_failover",
            "decode_load",
            "neutral_load",
        ]
    )
    rescheduling_interval_ms: Annotated[
        int,
        Meta(
            ge=1,
            description="period of the rescheduling loop; long enough for the statuses after one cycle's "
            "migrations to reach the view before the next cycle plans (use 100 with the binpacking policies)",
        ),
    ] = 500
    colocated_rescheduling_mode: Annotated[
        bool,
        Meta(
            description="run the rescheduler inside `pilotfish scheduler` (needs full mode); ignored when "
            "--standalone-rescheduling-mode is on"
        ),
    ] = True
    standalone_rescheduling_mode: Annotated[
        bool,
        Meta(description="the rescheduler runs as its own process (`pilotfish rescheduler`); the scheduler runs none"),
    ] = False
    rescheduling_decode_load_metric: Annotated[
        str, Meta(description="decode_load: the load metric of decode instances")
    ] = "kv_cache_usage_ratio_projected"
    rescheduling_decode_load_threshold: Annotated[
        float,
        Meta(description="decode_load: instances at or above this load are sources, those below destinations"),
    ] = 0.7
    rescheduling_neutral_load_metric: Annotated[
        str, Meta(description="neutral_load: the load metric of neutral instances")
    ] = "kv_cache_usage_ratio_projected"
    rescheduling_neutral_load_threshold: Annotated[
        float,
        Meta(description="neutral_load: instances at or above this load are sources, those below destinations"),
    ] = 0.7
    rescheduling_load_balance_threshold: Annotated[
        float,
        Meta(
            ge=0,
            description="load balance: minimum load difference (in the load metric's units) between a source "
            "and its destination",
        ),
    ] = 0.1
    rescheduling_load_balance_scope: Annotated[
        str, Meta(description="load balance: cluster (any pair) or unit (pairs within one unit_id only)")
    ] = "cluster"
    rescheduling_req_select_rule: Annotated[
        str, Meta(description="what --rescheduling-req-select-value counts: NUM_REQ, TOKEN or RATIO")
    ] = "TOKEN"
    rescheduling_req_select_order: Annotated[
        str, Meta(description="which requests migrate first: LCR, FCR, LR, SR, FCW or FCWSR")
    ] = "SR"
    rescheduling_req_select_value: Annotated[
        float,
        Meta(gt=0, description="requests (NUM_REQ), tokens (TOKEN) or fraction of the KV cache (RATIO) per migration"),
    ] = 1024.0
    rescheduling_migration_method: Annotated[
        str,
        Meta(
            description="auto (the source llumlet decides: KV transfer where a connector is configured), "
            "recompute or kv_transfer"
        ),
    ] = "auto"
    llumlet_grpc_connection_pool_size: Annotated[
        int,
        Meta(
            ge=1,
            description="gRPC channels per llumlet address; one HTTP/2 channel already multiplexes the calls "
            "of a cycle, which asks each source once",
        ),
    ] = 1
    llumlet_grpc_timeout_seconds: Annotated[
        float, Meta(gt=0, description="deadline of one Migrate call; a timeout counts as a failed rescheduling")
    ] = 10.0
    llumlet_token: Annotated[
        str,
        Meta(
            description="deprecated (visible in ps): sent to the llumlets as 'authorization: Bearer <token>'; "
            "use --auth-token-file, the one token of every link"
        ),
    ] = ""
    tpot_migrate_out_ceil_threshold: Annotated[
        float,
        Meta(gt=0, description="binpacking_mitigation: sources are predicted at or above tpot-slo x this"),
    ] = 0.95
    tpot_migrate_out_floor_threshold: Annotated[
        float,
        Meta(gt=0, description="binpacking_consolidation: sources are predicted below tpot-slo x this"),
    ] = 0.60
    enable_adaptive_pd: Annotated[
        bool,
        Meta(
            description="adaptive PD: needs --scheduling-policy slo and --tpot-slo; the binpacking_* rescheduling "
            "policies are its rescheduling half"
        ),
    ] = False
    # flow control (scheduler/flow/): hold Schedules while every eligible engine is saturated
    enable_flow_control: Annotated[
        bool,
        Meta(
            description="flow control: while every eligible engine is saturated (--flow-* bounds), a Schedule "
            "waits in the scheduler's queue, strict priority between bands and fair between flows, and is "
            "scheduled by the policy when an engine has room; shed (RESOURCE_EXHAUSTED: the gateway's 429) "
            "when the queue is full or its wait is over. Only requests whose gateway can hold them "
            "(queue_timeout_ms) wait"
        ),
    ] = False
    flow_lite_max_tokens: Annotated[
        int,
        Meta(
            ge=0,
            description="lite mode: an engine is saturated when the prompt and generated tokens of the requests "
            "the scheduler holds on it reach this (0: no token bound)",
        ),
    ] = 0
    flow_lite_max_requests: Annotated[
        int, Meta(ge=0, description="lite mode: an engine is saturated when it holds this many requests (0: no bound)")
    ] = 0
    flow_max_queued_prefill_tokens: Annotated[
        int,
        Meta(
            ge=0,
            description="full mode: an engine is saturated when its uncomputed prefill tokens plus the in-flight "
            "prompt tokens sent to it reach this (0: not judged)",
        ),
    ] = 8192
    flow_max_kv_usage: Annotated[
        float,
        Meta(
            ge=0,
            description="full mode: an engine is saturated when its projected KV usage "
            "(kv_cache_usage_ratio_projected) reaches this (0: not judged)",
        ),
    ] = 0.95
    flow_max_batch_requests: Annotated[
        int,
        Meta(
            ge=0,
            description="full mode: an engine is saturated when its running, loading and waiting requests plus "
            "in-flight ones reach this (0: its max_num_seqs from the CMS metadata, when known)",
        ),
    ] = 0
    flow_max_step_ms: Annotated[
        float,
        Meta(
            ge=0,
            description="full mode: an engine is saturated when its next step, predicted by its step-time fit "
            "from its queued prefill (at most its token budget), decode batch and context, would take this long "
            "(ms; 0: not judged): a bound in the TPOT SLO's unit, tighter where long answers keep batches large",
        ),
    ] = 0.0
    flow_critical_headroom_ms: Annotated[
        float,
        Meta(
            ge=0,
            description="full mode: while critical requests arrive (one within --flow-fair-share-window-ms), "
            "standard and sheddable ones also wait while every engine's queued prefill and one critical prompt "
            "(the recent mean of their prefill past the cached prefix), predicted by its step-time fit, would take "
            "this long to compute (ms; 0: not judged), so a critical request finds an engine that starts it soon; "
            "half a 2 s TTFT SLO by default",
        ),
    ] = 1000.0
    flow_queue_max_requests: Annotated[
        int,
        Meta(
            ge=1,
            le=1_000_000,
            description="requests the queue holds, all bands; past it the newest of a lower band is shed to make "
            "room, else the arrival",
        ),
    ] = 4096
    flow_critical_max_wait_ms: Annotated[
        float,
        Meta(ge=0, description="longest wait of a critical request; then the policy dispatches it, saturated or not"),
    ] = 3000.0
    flow_standard_max_wait_ms: Annotated[
        float, Meta(ge=0, description="longest wait of a standard request; then it is shed")
    ] = 2000.0
    flow_sheddable_max_wait_ms: Annotated[
        float,
        Meta(
            ge=0,
            description="longest wait of a sheddable request; it is shed then, or at once when the queue's "
            "drain rate says it would wait longer",
        ),
    ] = 1000.0
    flow_model_priorities: Annotated[
        list[str],
        Meta(
            description="model=band (critical, standard or sheddable): the band of a request of that model "
            "that carries none, as an InferenceObjective's priority (default: standard)"
        ),
    ] = []
    flow_recheck_ms: Annotated[
        float,
        Meta(
            gt=0,
            description="while requests wait, engines are judged again this often besides at every release, "
            "report and engine status",
        ),
    ] = 50.0
    flow_fair_share: Annotated[
        bool,
        Meta(
            description="fairness on what is dispatched: while more than one flow is active (in flight or "
            "waiting), a flow holding more than 1/active of the work in flight and waiting (tokens: prompt + "
            "max tokens), and asking for more than 1/active of the tokens arriving lately, is judged against "
            "the saturation bounds times --flow-over-share-bound, leaving the headroom to the flows within "
            "their share; a single flow is never judged so"
        ),
    ] = True
    flow_over_share_bound: Annotated[
        float,
        Meta(
            gt=0,
            le=1,
            description="the saturation bounds times this, for a flow over its fair share (--flow-fair-share): "
            "lite mode's bounds, the queued-prefill and KV bounds in full mode (the batch bound there is "
            "left to --flow-over-share-max-step-ms); lower isolates the other flows better and leaves engines idler",
        ),
    ] = 0.5
    flow_under_share_bound: Annotated[
        float,
        Meta(
            ge=1,
            le=16,
            description="full mode: --flow-max-queued-prefill-tokens times this for a flow within its fair "
            "share while another flow is over it (--flow-fair-share), so the light tenant's requests find room "
            "beside a held-back flood instead of waiting for its prefill to drain; the KV and batch bounds stay "
            "(1: the plain bound)",
        ),
    ] = 4.0
    flow_over_share_max_step_ms: Annotated[
        float,
        Meta(
            ge=0,
            description="full mode: a flow over its fair share (--flow-fair-share) also waits while every engine's "
            "next step, predicted by its step-time fit from its queued prefill (at most its token budget), decode "
            "batch and context, would take this long (ms; 0: not judged): another flow's first token waits about "
            "two steps, so this bounds what a flood adds to it (the batch bound is not scaled for that flow)",
        ),
    ] = 150.0
    flow_established_after_ms: Annotated[
        float,
        Meta(
            ge=0,
            description="flows (the tenant header's hash) are counted apart, for the queue's turns and the fair "
            "share, only once a flow id comes again at least this long after its first request; until then its "
            "requests share one flow with every other new id, so a client that sends a new id with every "
            "request gets one share, not one per id (0: every id is its own flow at once)",
        ),
    ] = 1000.0
    flow_fair_share_window_ms: Annotated[
        float,
        Meta(
            gt=0,
            description="time constant of the decayed per-flow arrival rates (tokens): a flow is over its "
            "share only while it also asks for more than 1/active of the tokens arriving lately",
        ),
    ] = 5000.0


def parse_instance(text: str) -> tuple[str, str]:
    """`host:port` or `id=host:port` -> (instance id, address); raises ConfigError naming the flag."""
    instance_id, sep, address = text.strip().rpartition("=")
    if not sep:
        instance_id, address = "", instance_id + address
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--instances: {text!r} is not host:port or id=host:port")
    if sep and not instance_id:
        raise ConfigError(f"--instances: {text!r} has an empty instance id")
    return instance_id or address, address


def validate(config: SchedulerConfig) -> list[tuple[str, str]]:
    """Checks msgspec cannot express; returns the parsed static instances as (id, address)."""
    if config.enable_full_mode_scheduling and config.instances:
        raise ConfigError("--instances: full mode takes its instances from the CMS; drop --instances")
    parsed = [parse_instance(text) for text in config.instances]
    seen: set[str] = set()
    for instance_id, _ in parsed:
        if instance_id in seen:
            raise ConfigError(f"--instances: instance id {instance_id!r} appears twice")
        seen.add(instance_id)
    if config.enable_full_mode_scheduling:
        try:
            check_id(config.cms_cluster, "cluster name")
        except BadId as exc:
            raise ConfigError(f"--cms-cluster: {exc}") from None
    if config.metrics_port and config.metrics_port == config.port:
        raise ConfigError(f"--metrics-port: {config.metrics_port} is also the gRPC --port")
    if config.session_port and config.session_port in (config.port, config.metrics_port):
        raise ConfigError(f"--session-port: {config.session_port} is also the gRPC or metrics port")
    if config.health_probes not in HEALTH_PROBES:
        raise ConfigError(f"--health-probes: {config.health_probes!r} is not one of {', '.join(HEALTH_PROBES)}")
    if config.outlier_max_ejection_seconds < config.outlier_base_ejection_seconds:
        raise ConfigError("--outlier-max-ejection-seconds: below --outlier-base-ejection-seconds")
    if not config.health_probe_path.startswith("/"):
        raise ConfigError(f"--health-probe-path: {config.health_probe_path!r} does not start with /")
    return parsed


HEALTH_PROBES = ("auto", "on", "off")


def probes_enabled(config: SchedulerConfig) -> bool:
    """--health-probes auto: lite mode only (full mode has the CMS status and its staleness)."""
    if config.health_probes == "auto":
        return not config.enable_full_mode_scheduling
    return config.health_probes == "on"


def validate_service(config: SchedulerConfig) -> None:
    """What serving needs beyond the core: full mode reads the CMS, so it needs Redis."""
    if config.enable_full_mode_scheduling and not config.redis_url:
        raise ConfigError(
            "--redis-url: full mode (--enable-full-mode-scheduling) reads the CMS from Redis; give its URL"
        )
