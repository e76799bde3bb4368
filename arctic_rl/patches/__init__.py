"""Every change arctic-rl makes at run time to another library's objects, one module per library.

- ``patches.lightning``: the only reader and caller of Lightning's private (``_``-prefixed) internals.
- ``patches.transformers``: instance ``forward`` overrides on a transformers model's modules, and functions
  replaced in a transformers modeling module.
- ``patches.deepspeed``: DeepSpeed's CPU process group started without its JIT-built shm op.

Each function names the upstream version it was written against and the test that pins it; if an upgrade breaks
one, it breaks here. ``scripts/check_structure.py`` refuses the same moves (Lightning's private names, assigning a
module's ``forward``, ``types.MethodType``, a function's ``__globals__``, ``setattr`` on a module) anywhere else.
"""
