"""arctic-rl as a backend: a service other RL frameworks drive through ``ArcticRLClient``.

The core's modules (this folder), lowest room first; each room imports only its own and lower ones
(``scripts/check_structure.py``, ``ROOMS``):

    operations.py ``Operations``: the service's operations as one contract (an ABC), implemented by the core,
                  the ranked core and the client; ``ops.py`` dispatches by its method names
    core.py       ``ServiceCore``: the one training job (a real Lightning run whose batches are requests),
                  plain methods, one per operation; service_module.py runs each with GRPOModule's code
    ops.py        ``CoreHandler``: a request message decoded into a core call and its answer encoded; the
                  only door into the core, whatever the transport; batch.py ``TrainBatch``
    transport.py  ``Message`` and ``Handler``: the boundary between every transport and the core
    wire.py       tensors as safetensors bytes + JSON metadata (no pickle on the network path)
    factory.py    the handler named by ``package.module:function``, called with the config dict
    config.py     ``ArcticRLClientConfig`` (pydantic): ``load(source, **overrides)`` raises one ``ConfigError``
    registry.py   post-forward processors by name (``register_processor``), built-ins and plugins; the service's
                  view of the core's one loss registry (``loss_registry.py``), with request errors
    security.py   the bind check, bearer tokens, and ``confine_path`` for paths a request names

    transports/   the same messages over HTTP (``http_app``, ``http_client``) and Ray (``ray_actor``), one request's
                  bytes answered (``serving.Endpoint``), a server in its own process (``process``)
    ranks/        ``RankedCore``: several training ranks behind one front (``ranked``), each a local process
                  (``processes``) or a Ray actor (``actors``) serving ``worker``'s handler (``placement``: the two
                  behind one interface), a batch split between them (``split``); ``ranked.build_handler`` is the
                  default handler factory (one rank or several, by ``training.devices x num_nodes``)
    tinker/       the Tinker API over the core (``arctic-rl serve --api tinker``)

    server.py     runs an app with uvicorn (``python -m arctic_rl.serve.server``), ours or Tinker's
    client.py     ``ArcticRLClient``: local (in-process), http or ray
    async_loop.py ``run_async``: over the client, a producer thread samples ahead of the trainer within a staleness
                  bound, each sequence stamped with the policy version that sampled it
"""
