"""Writes BIRD text-to-SQL prompts for arctic-rl from the unpacked BIRD archives: see README.md."""

from arctic_rl.recipes.bird import main

if __name__ == "__main__":
    main()
