"""One fresh process of tests/test_determinism.py: three calls on each backend
named in argv, path "auto", and the SHA-256 of each output's bytes, as JSON
on stdout. Run with the user's environment: no ATTENTION_MULTI_CALL_COST."""

import hashlib
import json
import sys

import numpy as np


def calls(xp):
    """(name, function) of the three calls: a block-table mask (its sparsity in
    its tables alone), padding by lengths, packed documents with causal."""
    import attention_multi as am
    from attention_multi.core.mask.blocks import BlockMask

    rng = np.random.default_rng(0)

    def arr(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32))

    T, BS = 512, 64
    n = T // BS
    states = np.zeros((1, 1, n, n), np.int8)
    for i in range(n):  # (each block row: two key blocks, partial where the function decides)
        states[0, 0, i, [i, (i * 5 + 3) % n]] = 1
    table = BlockMask(lambda b, h, q, kv: kv <= q + 300, states, (1, 1, T, T), BS, BS, binding=True)
    q1, k1, v1 = arr(2, 2, T, 32), arr(2, 2, T, 32), arr(2, 2, T, 32)
    q2, k2, v2 = arr(16, 4, T, 16), arr(16, 4, T, 16), arr(16, 4, T, 16)
    lens = xp.asarray(rng.integers(T // 4, T + 1, 16).astype(np.int32))
    q3, k3, v3 = arr(1, 4, 1024, 16), arr(1, 4, 1024, 16), arr(1, 4, 1024, 16)
    docs = xp.asarray(np.asarray(am.segments_from_lengths([[300, 200, 400, 124]], 1024)))
    return [
        ("block table", lambda: am.dot_product_attention(q1, k1, v1, mask_mod=table)),
        ("valid_lens", lambda: am.dot_product_attention(q2, k2, v2, valid_lens=lens)),
        (
            "packed causal",
            lambda: am.dot_product_attention(q3, k3, v3, segment_ids=docs, causal=True),
        ),
    ]


def main(names):
    import attention_multi as am

    out = {}
    for name in names:
        xp = am.get_backend(name)
        for case, run in calls(xp):
            y = np.ascontiguousarray(xp.to_numpy(run()))
            out[f"{name} {case}"] = hashlib.sha256(y.tobytes()).hexdigest()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
