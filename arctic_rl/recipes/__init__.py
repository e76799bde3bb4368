"""Task recipes: rewards and data preparation for GSM8K, multi-hop QA, BIRD text-to-SQL and the search agent
(``arctic-rl prepare NAME --out DIR``; the recipes' READMEs, configs and smoke configs are in recipes/)."""

from __future__ import annotations

import sys
from importlib import import_module

RECIPES = ("gsm8k", "multihop_qa", "bird", "search_agent")


def prepare_main(argv: list[str]) -> None:
    """``arctic-rl prepare NAME [args]``: run ``arctic_rl.recipes.NAME.main(args)``, which reports a bad
    input as one line naming it, with exit status 2 (as this does an unknown NAME)."""
    if not argv or argv[0] not in RECIPES:
        got = f"got {argv[0]!r}" if argv else "none given"
        print(f"usage: arctic-rl prepare {{{','.join(RECIPES)}}} --out DIR [--source ...] ({got})", file=sys.stderr)
        sys.exit(2)
    import_module(f"arctic_rl.recipes.{argv[0]}").main(argv[1:])
