"""The Cluster Metadata Store: Redis key layout (keys.py) and strict record decoding (records.py),
shared by the llumlet's writer and the scheduler's reader."""
