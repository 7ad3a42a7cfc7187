"""Scheduling metrics, one module per family; each metric is one class registered by its spec name."""
