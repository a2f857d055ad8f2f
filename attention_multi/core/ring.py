"""Ring (sequence-parallel) attention, written once against the protocol.

Queries, keys and values are split along the sequence over ``size``
participants (processes or devices), each holding equal consecutive shards:
participant ``r`` holds queries ``[r Q, (r+1) Q)`` and keys and values
``[r K, (r+1) K)`` of the whole sequence. In ``size`` steps each one attends
its queries to the block of keys and values it holds, merges the result into
its running online-softmax state (``softmax_block``/``merge_blocks``/
``finish_blocks`` of ``paths.py``) and passes the block to its neighbour
(``r`` to ``r + 1``), receiving the block of ``r - 1``. After the last step it
has attended every block (also those none of its queries sees: under autodiff
every exchange must be in every participant's graph, so that the backward
exchanges pair up; keys and values travel as one message). Memory per
participant: its shards, one block in flight, the (Q, dv) state, and the
scores of a block of queries within the memory budget: O(T/P d).

The communication is the backend's ``ring_exchange(group)`` capability:
``(rank, size, shift)``, ``shift(x)`` sending ``x`` to the next participant
and returning what the previous one sent (torch.distributed point-to-point,
``jax.lax.ppermute`` inside ``shard_map``); ``rank`` may be traced (JAX), so
the mask of each block is computed from a possibly traced key position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .masking import compute_dtype
from .paths import (
    _scaled,
    expand_kv,
    finish_blocks,
    merge_blocks,
    queries_per_block,
    softmax_block,
)

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array
    from .masking import Mask


def ring(
    B: Backend,
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
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    batch, heads, num_q = q.shape[:3]
    block, d = k.shape[2], k.shape[-1]
    block_q = queries_per_block(B, q, block, memory_budget)
    rows = [(q0, min(num_q, q0 + block_q)) for q0 in range(0, num_q, block_q)]
    qs = [_scaled(B, q[:, :, q0:q1], scale, work) for q0, q1 in rows]
    kv = B.concatenate([k, v], -1)  # one message per step
    states: list[Any] = [None] * len(rows)
    for step in range(size):
        owner = (rank - step) % size  # whose block this participant holds now
        keys_mask = mask.keys_from(owner * block, block)

        kb, vb = expand_kv(B, kv[..., :d], kv[..., d:], heads)
        kb, vb = keys_mask.guard_unused(B, kb, vb)  # (once per step, as on the chunked path)
        for i, (q0, q1) in enumerate(rows):
            sub = keys_mask if len(rows) == 1 else keys_mask.sub(0, batch, q0, q1, 0, block)

            def attend_block(
                state: Any, q_rows: Array, kb: Array, vb: Array, sub: Mask = sub
            ) -> Any:
                return merge_blocks(B, state, softmax_block(B, q_rows, kb, vb, sub, work))

            # (every block is attended, even one no local query sees: under
            # autodiff each exchange must be part of every participant's graph,
            # or the backward exchanges would not pair up; each block of
            # queries is recomputed in the backward pass)
            states[i] = B.checkpoint(attend_block, states[i], qs[i], kb, vb)
        if step + 1 < size:
            kv = shift(kv)
    outs = [finish_blocks(B, state) for state in states]
    out = outs[0] if len(outs) == 1 else B.concatenate(outs, 2)
    return B.astype(out, dtype) if work != dtype else out
