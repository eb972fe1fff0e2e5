"""The one error type nabla raises for bad meshes, specs, placements and mixing."""

from __future__ import annotations


class ShardingError(ValueError):
    """A sharding request that cannot be honoured; the message names op, operand, dim, axis and sizes."""



class ShardingIndexError(ShardingError, IndexError):
    """An index out of range: a ShardingError that code written for numpy, catching IndexError, catches too."""
