"""Ring (sequence-parallel) attention, written once against the protocol.

Queries, keys and values are split along the sequence over ``size``
participants (processes or devices), each holding equal consecutive shards:
participant ``r`` holds queries ``[r Q, (r+1) Q)`` and keys and values
``[r K, (r+1) K)`` of the whole sequence. In ``size`` steps each one attends
its queries to the block of keys and values it holds, merges the result into
its running online-softmax state (``online.py``) and passes the block to its
neighbour (``r`` to ``r + 1``), receiving the block of ``r - 1``. After the
last step it has attended every block (also those none of its queries sees:
under autodiff every exchange must be in every participant's graph, so that
the backward exchanges pair up; keys and values travel as one message).
Memory per participant: its shards, one block in flight, the (Q, dv) state,
and the scores of a block of queries within the memory budget: O(T/P d).

The communication is the backend's ``ring_exchange(group)`` capability:
``(rank, size, shift)``, ``shift(x)`` sending ``x`` to the next participant
and returning what the previous one sent (torch.distributed point-to-point,
``jax.lax.ppermute`` inside ``shard_map``); ``rank`` may be traced (JAX), so
the mask of each block is computed from a possibly traced key position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..mask.rules import guard_unused
from ..mask.spec import Region
from ..numerics import compute_dtype, in_dtype, scaled
from . import online
from .call import expand_kv
from .chunked import queries_per_block

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array
    from ..mask import Mask


def ring(
    xp: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    rank: int | Array,
    size: int,
    shift: Callable[[Array], Array],
    memory_budget: int,
) -> Array:
    """Attention of the local queries ``q`` (batch, heads, Q, d) over the
    keys and values of every participant; ``k``, ``v`` (batch, kv_heads, K,
    d|dv) are the local blocks. ``mask`` is the local queries' ``Mask`` over
    all ``size * K`` keys (positions of the whole sequence). The scores of a
    step are computed a block of queries at a time, within ``memory_budget``
    bytes as on the chunked path. Returns (batch, heads, Q, dv) in the dtype
    of ``q``."""
    work = compute_dtype(xp.dtype_name(q))
    batch, heads, num_q = q.shape[:3]
    block, d = k.shape[2], k.shape[-1]
    block_q = queries_per_block(xp, q, block, memory_budget)
    rows = [(q0, min(num_q, q0 + block_q)) for q0 in range(0, num_q, block_q)]
    qs = [scaled(xp, q[:, :, q0:q1], scale, work) for q0, q1 in rows]
    kv = xp.concatenate([k, v], -1)  # one message per step
    states: list[Any] = [None] * len(rows)
    for step in range(size):
        owner = (rank - step) % size  # whose block this participant holds now
        keys_mask = mask.keys_from(owner * block, block)
        kb, vb = expand_kv(xp, kv[..., :d], kv[..., d:], heads)
        kb, vb = guard_unused(xp, keys_mask, kb, vb)  # (once per step, as on the chunked path)
        for i, (q0, q1) in enumerate(rows):
            sub = (
                keys_mask
                if len(rows) == 1
                else keys_mask.region(Region(0, batch, q0, q1, 0, block))
            )
            # (every block is attended, even one no local query sees: under
            # autodiff each exchange must be part of every participant's graph,
            # or the backward exchanges would not pair up)
            states[i] = online.step(xp, states[i], qs[i], kb, vb, sub, work)
        if step + 1 < size:
            kv = shift(kv)
    outs = [online.finish(xp, state) for state in states]
    out = outs[0] if len(outs) == 1 else xp.concatenate(outs, 2)
    return in_dtype(xp, out, xp.dtype_name(q))
