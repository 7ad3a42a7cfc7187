"""The policy framework: metrics -> filters -> selector, composed by name (see registry.py)."""
