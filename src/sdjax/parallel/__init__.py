"""Parallel execution: the guides' pmap helpers and the Mesh/NamedSharding path."""

from sdjax.parallel.pmap import replicate, shard, unreplicate
from sdjax.parallel.sharding import DEFAULT_RULES, make_mesh, param_specs, shard_params

__all__ = ["DEFAULT_RULES", "make_mesh", "param_specs", "replicate", "shard", "shard_params", "unreplicate"]
