"""The HTTP face of a simulated engine: vLLM's OpenAI endpoints, /health and /metrics."""
