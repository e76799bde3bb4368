"""Rewards of the recipes, each a pure function over strings (SQL's runs in a worker pool)."""
