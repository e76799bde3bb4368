"""Task recipes: rewards and data preparation for GSM8K, multi-hop QA, BIRD text-to-SQL and the search agent
(``arctic-rl prepare NAME --out DIR``; the recipes' READMEs, configs and smoke configs are in recipes/)."""

from __future__ import annotations

import sys
from importlib import import_module

RECIPES = ("gsm8k", "multihop_qa", "bird", "search_agent")
PREPARE_HELP = """usage: arctic-rl prepare {{{recipes}}} --out DIR [--source ...]

A recipe's prompt data (recipes/<name>/README.md):
  gsm8k         GSM8K math word problems (--source: a directory of the downloaded files; default: the hub)
  multihop_qa   HotpotQA / MuSiQue questions packed into long-context prompts (--source: a .json / .jsonl / .parquet file)
  bird          BIRD text-to-SQL questions and their databases (--source: an unpacked split, required)
  search_agent  multi-hop questions and a BM25 index of their documents, for the search tools (--source: as multihop_qa)

arctic-rl prepare NAME --help lists a recipe's options."""


def prepare_main(argv: list[str]) -> None:
    """``arctic-rl prepare NAME [args]``: run ``arctic_rl.recipes.NAME.main(args)``, which reports a bad
    input as one line naming it, with exit status 2 (as this does an unknown NAME)."""
    if argv and argv[0] in ("-h", "--help"):
        print(PREPARE_HELP.format(recipes="|".join(RECIPES)))
        return
    if not argv or argv[0] not in RECIPES:
        got = f"got {argv[0]!r}" if argv else "none given"
        print(f"usage: arctic-rl prepare {{{','.join(RECIPES)}}} --out DIR [--source ...] ({got})", file=sys.stderr)
        sys.exit(2)
    import_module(f"arctic_rl.recipes.{argv[0]}").main(argv[1:])
