"""Writes search-agent questions and the BM25 index of their documents for arctic-rl: see README.md."""

from arctic_rl.recipes.search_agent import main

if __name__ == "__main__":
    main()
