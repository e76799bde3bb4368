"""An OpenAI-compatible front for a sampler: chat and text completion requests checked field by field and rendered
once through the chat template (``fields``), sampled and recorded token for token per session (``service``,
``episodes``), answered over HTTP (``routes``). The service's ``--api openai`` and ``fit``'s agent rollouts
(``agents``) both serve it."""
