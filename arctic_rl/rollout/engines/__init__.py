"""The rollout engines: the boundary every engine answers (``base``), the table of engine kinds and the factory
(``factory``), and one subpackage per implementation (``vllm``, ``transformers``) plus ``ray`` (an engine in a Ray
actor, and pools of them). Importing this package imports no engine."""
