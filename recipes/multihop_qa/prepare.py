"""Writes multi-hop QA prompts (HotpotQA or MuSiQue) for arctic-rl: see README.md."""

from arctic_rl.recipes.multihop_qa import main

if __name__ == "__main__":
    main()
