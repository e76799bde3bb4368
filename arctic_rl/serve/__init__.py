"""arctic-rl as a backend: a service other RL frameworks drive through ``ArcticRLClient``.

    core.py       the one training core (a real Lightning run whose "data" are requests)
    ops.py        the operations' request schemas and ``dispatch``: the only door into the core
    wire.py       tensors as safetensors bytes + JSON metadata (no pickle on the network path)
    serving.py    ``Endpoint``: one request's bytes answered (decode, one op at a time, encode), for both below
    factory.py    the handler named by ``package.module:function``, called with the config dict
    http_app.py   FastAPI app (thin: body in, ``Endpoint``, body out); http_client.py ``HttpTransport``
    server.py     runs the app with uvicorn (``python -m arctic_rl.serve.server``); ``start_server_process``
    ray_actor.py  the same ``Endpoint`` in a Ray actor (thin), and ``RayTransport``
    client.py     ``ArcticRLClient``: local (in-process), http or ray
"""
