"""``KVCache``: the keys and values a ``MultiHeadAttention`` has decoded so far.

Made by ``MultiHeadAttention.init_cache(batch_size, max_len)``: projected keys
and values (batch, num_kv_heads, max_len, head_size), preallocated so that a
step's shapes never change (a ``jax.jit``-compiled step compiles once), and
``length``, a 0-d int32 array: how many positions are filled. A call
``out, cache = mha(queries, keys, values, cache=cache)`` returns a new cache
and leaves the old one unchanged. Under JAX it is a pytree (``jax.jit`` takes
and returns it, its length traced); elsewhere a small object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..types import Array


class KVCache:
    """Keys and values (batch, num_kv_heads, max_len, head_size) and the
    filled ``length`` (0-d int32 array)."""

    __slots__ = ("keys", "values", "length")

    keys: Array
    """The projected keys, (batch, num_kv_heads, max_len, head_size); positions
    from ``length`` on are not yet written."""
    values: Array
    """The projected values, laid out as ``keys``."""
    length: Array
    """How many positions are filled: a 0-d int32 array of the backend (traced
    under ``jax.jit``, so one compiled step serves every position)."""

    def __init__(self, keys: Array, values: Array, length: Array) -> None:
        self.keys, self.values, self.length = keys, values, length

    @property
    def max_len(self) -> int:
        """The positions the cache holds (``init_cache``'s ``max_len``)."""
        return self.keys.shape[2]

    @property
    def batch_size(self) -> int:
        """The batch the cache was made for."""
        return self.keys.shape[0]

    def __repr__(self) -> str:
        return (
            f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.keys.shape[1]}, "
            f"max_len={self.max_len}, head_size={self.keys.shape[3]})"
        )

    def _flatten(self) -> tuple[tuple[Array, Array, Array], None]:
        return (self.keys, self.values, self.length), None

    @classmethod
    def _unflatten(cls, aux: None, children: tuple[Array, Array, Array]) -> KVCache:
        return cls(*children)
