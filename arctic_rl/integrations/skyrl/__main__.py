"""``python -m arctic_rl.integrations.skyrl serve ...``: see ``launch.py``."""

from arctic_rl.integrations.skyrl.launch import main

main()
