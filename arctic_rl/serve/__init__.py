"""arctic-rl as a backend: a service other RL frameworks drive through ``ArcticRLClient``.

    core.py       the one training core (a real Lightning run whose "data" are requests)
    ops.py        the operations' request schemas and ``dispatch``: the only door into the core
    wire.py       tensors as safetensors bytes + JSON metadata (no pickle on the network path)
    http_app.py   FastAPI app (thin: decode, dispatch, encode); server.py runs it (``arctic-rl serve``)
    ray_actor.py  the same core in a Ray actor (thin)
    client.py     ``ArcticRLClient``: local (in-process), http or ray
    config.py     ``ArcticRLClientConfig`` (pydantic): ``load(source, **overrides)`` raises one ``ConfigError``
    registry.py   losses and post-forward processors by name (``register_loss``), built-ins and plugins
    security.py   the bind check, bearer tokens, and ``confine_path`` for paths a request names
"""
