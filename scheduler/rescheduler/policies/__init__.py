"""Rescheduling policies, one class each: load balance, failover, adaptive-PD binpacking."""
