"""The vLLM engine: the engine itself, its worker extension (weights received by the workers) and its environment."""
