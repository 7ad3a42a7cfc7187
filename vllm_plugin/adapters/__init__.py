"""Engine adapters: translate one engine's events into the llumlet core's calls."""
