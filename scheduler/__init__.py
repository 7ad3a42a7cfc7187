"""The scheduler: picks the engine for each request (lite mode: local real-time state; full mode:
the llumlets' CMS records in Redis, with the in-flight account and forward prediction).

`core.SchedulerCore` is the synchronous scheduling core (usable in-process by a colocated
gateway); `service.SchedulerServer` puts it behind gRPC; `policy/` holds the
metrics -> filters -> selector framework and `view/` what the policy reads. Nothing is
imported here, so `pilotfish --help` stays fast.
"""
