"""Writes GSM8K prompts (train.jsonl, test.jsonl) for arctic-rl: see README.md."""

from arctic_rl.recipes.gsm8k import main

if __name__ == "__main__":
    main()
