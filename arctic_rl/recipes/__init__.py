"""Task recipes: rewards and data preparation for GSM8K, multi-hop QA and BIRD text-to-SQL."""
