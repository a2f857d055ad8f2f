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
exchanges pair up; keys and values travel as one message). Memory per participant: its shards, one block in
flight, and the (Q, dv) state: O(T/P d).

The communication is the backend's ``ring_exchange(group)`` capability:
``(rank, size, shift)``, ``shift(x)`` sending ``x`` to the next participant
and returning what the previous one sent (torch.distributed point-to-point,
``jax.lax.ppermute`` inside ``shard_map``); ``rank`` may be traced (JAX), so
the mask of each block is computed from a possibly traced key position.
"""
from .masking import compute_dtype
from .paths import _scaled, expand_kv, finish_blocks, merge_blocks, softmax_block


def ring(B, q, k, v, mask, scale, rank, size, shift):
    """Attention of the local queries ``q`` (batch, heads, Q, d) over the
    keys and values of every participant; ``k``, ``v`` (batch, kv_heads, K,
    d|dv) are the local blocks. ``mask`` is the local queries' ``Mask`` over
    all ``size * K`` keys (positions of the whole sequence). Returns (batch,
    heads, Q, dv) in the dtype of ``q``."""
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    block, d = k.shape[2], k.shape[-1]
    qs = _scaled(B, q, scale, work)
    kv = B.concatenate([k, v], -1)          # one message per step
    state = None
    for step in range(size):
        owner = (rank - step) % size          # whose block this participant holds now
        sub = mask.keys_from(owner * block, block)

        def attend_block(state, qs, kv, sub=sub):
            kb, vb = expand_kv(B, kv[..., :d], kv[..., d:], q.shape[1])
            kb, vb = sub.guard_unused(B, kb, vb)
            return merge_blocks(B, state, softmax_block(B, qs, kb, vb, sub, work))
        # (every block is attended, even one no local query sees: under
        # autodiff each exchange must be part of every participant's graph,
        # or the backward exchanges would not pair up)
        state = B.checkpoint(attend_block, state, qs, kv)
        if step + 1 < size:
            kv = shift(kv)
    out = finish_blocks(B, state)
    return B.astype(out, dtype) if work != dtype else out
