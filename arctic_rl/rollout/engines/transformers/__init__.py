"""arctic-rl's own transformers engine: batched decode over a static cache, its attention and sampling."""
