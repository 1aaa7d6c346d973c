"""Parallel execution: the guides' pmap helpers and the Mesh/NamedSharding path."""

from sdjax.parallel.pmap import replicate, shard, unreplicate

__all__ = ["replicate", "shard", "unreplicate"]
