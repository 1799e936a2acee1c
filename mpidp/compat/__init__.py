"""Drop-in layers for code written against other domain-parallel APIs: change one import.

* :mod:`mpidp.compat.credit` - NCAR CREDIT's ``credit.domain_parallel`` and ``credit.parallel``;
* :mod:`mpidp.compat.physicsnemo` - NVIDIA PhysicsNeMo's ``physicsnemo.distributed`` (manager,
  ``utils``, ``autograd``, ``fft``, ``mappings``) and ``physicsnemo.domain_parallel``
  (``ShardTensor``, ``scatter_tensor``);
* :mod:`mpidp.compat.anemoi` - ECMWF anemoi's ``anemoi.models.distributed`` (``graph``,
  ``khop_edges``, ``shapes``, ``transformer``, ``utils``; :mod:`mpidp.anemoi` re-exports its
  old form for one release).

Each name keeps its source's signature, defaults, return values and meaning, and is a thin
layer over mpidp's one implementation (no numerics of its own). Where the source is right only
in a special case (even shards), the compat name is right in general; where a name cannot keep
its meaning, it raises :class:`mpidp.ConfigError` with the reason. docs/migration.md lists
every name.
"""
