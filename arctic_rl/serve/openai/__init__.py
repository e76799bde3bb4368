"""The OpenAI-compatible endpoint (``arctic-rl serve --api openai``): chat and text completions whose exact tokens become training episodes."""
