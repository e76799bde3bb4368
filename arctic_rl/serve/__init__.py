"""arctic-rl as a backend: a service other RL frameworks drive through ``ArcticRLClient``.

    core.py       ``TrainingCore``: the one training job (a real Lightning run whose batches are requests),
                  plain methods, one per operation; service_module.py runs each with GRPOModule's code
    ops.py        ``CoreHandler``: a request message decoded into a core call and its answer encoded; the
                  only door into the core, whatever the transport; batch.py ``TrainBatch``
    wire.py       tensors as safetensors bytes + JSON metadata (no pickle on the network path)
    serving.py    ``Endpoint``: one request's bytes answered (decode, one op at a time, encode), for both below
    factory.py    the handler named by ``package.module:function``, called with the config dict
    http_app.py   FastAPI app (thin: body in, ``Endpoint``, body out); http_client.py ``HttpTransport``
    server.py     runs the app with uvicorn (``python -m arctic_rl.serve.server``); process.py
                  ``start_server_process`` launches it in its own process group
    ray_actor.py  the same ``Endpoint`` in a Ray actor (thin), and ``RayTransport``
    client.py     ``ArcticRLClient``: local (in-process), http or ray
    config.py     ``ArcticRLClientConfig`` (pydantic): ``load(source, **overrides)`` raises one ``ConfigError``
    registry.py   post-forward processors by name (``register_processor``), built-ins and plugins; the service's
                  view of the core's one loss registry (``modules/loss_registry.py``), with request errors
    security.py   the bind check, bearer tokens, and ``confine_path`` for paths a request names
"""
