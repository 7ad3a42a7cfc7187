"""The llumlet: Pilotfish's vLLM plugin (entry point `vllm.general_plugins`)."""


def register() -> None:
    """vLLM calls this in every process it starts; inert until the llumlet lands (issue 6)."""
