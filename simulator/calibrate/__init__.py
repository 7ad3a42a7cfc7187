"""`pilotfish sim calibrate`: fit a step-time profile to a running engine from timed requests.

`fit.fit_profile` (least squares), `measure.measure` (the workload), `probes` (HTTP, or the
engine model in virtual time), `command` (the CLI). Nothing is imported here, so the CLI's
argument parsing stays light.
"""
