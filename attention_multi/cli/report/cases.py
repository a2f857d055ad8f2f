"""What the report checks: fixed inputs, and each mechanism run two ways
(on a backend, through a ``Runner``; and by the float64 reference)."""

import numpy as np

from ... import reference as ref
from ...backends.capabilities import opt

DTYPES = ("float32", "float64")
TOLERANCES = {"float32": (2e-5, 1e-5), "float64": (1e-10, 1e-10)}  # (atol, rtol)


def target(x):
    """Seed 003's target function."""
    return 2 * np.sin(x) + x**0.8


def make_inputs(seed=0):
    """All inputs and weights, float64 NumPy (lengths are int64)."""
    rng = np.random.default_rng(seed)
    normal, uniform = rng.standard_normal, rng.uniform

    def linear_params(prefix, out, inp, bias):
        bound = 1 / np.sqrt(inp)
        p = {f"{prefix}.weight": uniform(-bound, bound, (out, inp))}
        if bias:
            p[f"{prefix}.bias"] = uniform(-bound, bound, (out,))
        return p

    def mha_params(bias):
        p = {}
        for name, size in (("W_q", 5), ("W_k", 3), ("W_v", 7), ("W_o", 8)):
            p.update(linear_params(name, 8, size, bias))
        return p

    x_train = np.sort(rng.random(50) * 5)
    y_train = target(x_train) + rng.normal(0.0, 0.5, 50)
    others = ~np.eye(50, dtype=bool)
    return {
        "X": normal((2, 2, 4)),
        "lens1": np.array([2, 3]),
        "X2": normal((2, 3, 5)),
        "lens2": np.array([[1, 3, 5], [2, 4, 0]]),
        "S": normal((3, 5)),
        "S_lens": np.array([0, 2, 5]),
        # seed 000: keys of ones, values arange(40), valid_lens [2, 6]
        "seed_keys": np.ones((2, 10, 2)),
        "seed_values": np.tile(np.arange(40.0).reshape(1, 10, 4), (2, 1, 1)),
        "seed_lens": np.array([2, 6]),
        "dot_q": normal((2, 1, 2)),
        "add_q": normal((2, 1, 20)),
        "add_params": {
            **linear_params("W_q", 8, 20, False),
            **linear_params("W_k", 8, 2, False),
            **linear_params("w_v", 1, 8, False),
        },
        "q": normal((2, 3, 4)),
        "k": normal((2, 5, 4)),
        "v": normal((2, 5, 3)),
        "mq": normal((2, 4, 5)),
        "mk": normal((2, 6, 3)),
        "mv": normal((2, 6, 7)),
        "m_lens": np.array([3, 5]),
        "mha": mha_params(False),
        "mha_bias": mha_params(True),
        "P_X": normal((2, 7, 6)),
        "x_train": x_train,
        "y_train": y_train,
        "x_test": np.arange(0, 5, 0.1),
        "forms_mask": np.array(
            [
                [[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]],
                [[0, 1, 1, 1, 1], [1, 1, 0, 0, 1], [0, 0, 1, 0, 0]],
            ],
            bool,
        ),
        "forms_bias": np.where(rng.random((2, 3, 5)) < 0.2, -np.inf, normal((2, 3, 5))),
        "gqa": {
            **linear_params("W_q", 8, 5, True),
            **linear_params("W_k", 4, 5, True),
            **linear_params("W_v", 4, 5, True),
            **linear_params("W_o", 8, 8, True),
        },
        "gqa_x": normal((2, 4, 5)),
        "nw_w": np.array([1.7]),
        "nw_keys": np.tile(x_train, (50, 1))[others].reshape(50, -1),
        "nw_values": np.tile(y_train, (50, 1))[others].reshape(50, -1),
        # the programmable forms: packed documents over the 5 keys of q, k, v (-1: padding;
        # the queries sit at the last 3 positions), ALiBi's slopes for 2 heads
        "doc_ids": np.array([[0, 0, 1, 1, -1], [0, 1, 1, 1, 2]]),
        "alibi_slopes": np.array([0.5, 0.25]),
        # the heatmap's packed row: documents of 5, 7 and 4 tokens
        "packed_ids": np.repeat(np.arange(3), [5, 7, 4])[None],
        "packed_x": normal((1, 16, 8)),
    }


def rounded(inputs, dtype):
    """Floats rounded to ``dtype`` (kept float64), so the reference sees
    exactly what the backend sees."""
    if isinstance(inputs, dict):
        return {k: rounded(v, dtype) for k, v in inputs.items()}
    if inputs.dtype.kind == "f":
        return inputs.astype(dtype).astype(np.float64)
    return inputs


def _attention(r, net, q, k, v, lens):
    return [net(r.a(q), r.a(k), r.a(v), r.lens(lens)), net.attention_weights]


def _mha(r, i, params):
    net = r.module(
        r.am.MultiHeadAttention, 3, 5, 7, 8, 2, 0.5, bias="W_q.bias" in params, params=params
    )
    return _attention(r, net, i["mq"], i["mk"], i["mv"], i["m_lens"])


def _forms(r, i, **forms):
    """The functional attention on q, k, v with ``forms`` (arrays NumPy)."""

    def native(x):
        if not isinstance(x, np.ndarray):
            return x
        return r.mask(x) if x.dtype == bool else r.lens(x) if x.dtype.kind in "iu" else r.a(x)

    native = {n: native(x) for n, x in forms.items()}
    return [r.am.dot_product_attention(r.a(i["q"]), r.a(i["k"]), r.a(i["v"]), **native)]


def _ref_forms(i, **forms):
    forms = {n: x[:, None] if n in ("mask", "bias") else x for n, x in forms.items()}
    out, _ = ref.attention(i["q"][:, None], i["k"][:, None], i["v"][:, None], **forms)
    return [out[:, 0]]


def _gqa(r, i, **forms):
    net = r.module(
        r.am.MultiHeadAttention, 5, 5, 5, 8, 2, 0.5, bias=True, num_kv_heads=1, params=i["gqa"]
    )
    x = r.a(i["gqa_x"])
    return [net(x, x, x, **forms)]


def _documents(ids, offset):
    """mask_mod: a query (at key position ``q_idx + offset``) sees its own
    document's keys; negative ids are padding (such a query sees nothing)."""

    def document(b, h, q_idx, kv_idx):
        own = ids[b, q_idx + offset]
        return (own == ids[b, kv_idx]) & (own >= 0)

    return document


def _sliding_window_with_sinks(b, h, q_idx, kv_idx):
    """mask_mod: causal over the last 2 keys, and the first key for every query."""
    return ((kv_idx <= q_idx) & (q_idx - kv_idx <= 1)) | (kv_idx < 1)


def _alibi(slopes, B=None):
    """With a backend ``B``, through its ops (TensorFlow indexes by no tensor
    and multiplies no integer by a float); else NumPy's (the reference)."""

    def alibi(score, b, h, q_idx, kv_idx):
        if B is None:
            return score + slopes[h] * (kv_idx - q_idx)
        rs = opt(B).reshape
        slope = rs(B.take(slopes, rs(h, (-1,)), 0), tuple(h.shape))
        return score + slope * B.astype(kv_idx - q_idx, B.dtype_name(score))

    return alibi


def _softcap(tanh):
    def softcap(score, b, h, q_idx, kv_idx):
        return 1.5 * tanh(score / 1.5)

    return softcap


def _decode(r, i):
    """One token at a time through a KV cache."""
    net = r.module(
        r.am.MultiHeadAttention, 5, 5, 5, 8, 2, 0.5, bias=True, num_kv_heads=1, params=i["gqa"]
    )
    cache, outs = net.init_cache(2, 6), []
    x = r.a(i["gqa_x"])
    for t in range(x.shape[1]):
        out, cache = net(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache)
        outs.append(out)
    return outs


def _ref_gqa(i, steps=False, **forms):
    x = i["gqa_x"]
    out, _ = ref.multi_head_attention(i["gqa"], x, x, x, None, 2, 1, **forms)
    return [out[:, t : t + 1] for t in range(x.shape[1])] if steps else [out]


# (row name, run on a backend -> arrays, reference -> float64 arrays)
CASES = [
    (
        "masked_softmax, valid_lens (B,)",
        lambda r, i: [r.am.masked_softmax(r.a(i["X"]), r.lens(i["lens1"]))],
        lambda i: [ref.masked_softmax(i["X"], i["lens1"])],
    ),
    (
        "masked_softmax, valid_lens (B, Q)",
        lambda r, i: [r.am.masked_softmax(r.a(i["X2"]), r.lens(i["lens2"]))],
        lambda i: [ref.masked_softmax(i["X2"], i["lens2"])],
    ),
    (
        "sequence_mask",
        lambda r, i: [r.am.sequence_mask(r.a(i["S"]), r.lens(i["S_lens"]), value=-1.0)],
        lambda i: [ref.sequence_mask(i["S"], i["S_lens"], -1.0)],
    ),
    (
        "DotProductAttention, seed example",
        lambda r, i: _attention(
            r,
            r.module(r.am.DotProductAttention, 0.5),
            i["dot_q"],
            i["seed_keys"],
            i["seed_values"],
            i["seed_lens"],
        ),
        lambda i: list(
            ref.dot_product_attention(i["dot_q"], i["seed_keys"], i["seed_values"], i["seed_lens"])
        ),
    ),
    (
        "DotProductAttention, valid_lens (B, Q)",
        lambda r, i: _attention(
            r, r.module(r.am.DotProductAttention, 0.5), i["q"], i["k"], i["v"], i["lens2"]
        ),
        lambda i: list(ref.dot_product_attention(i["q"], i["k"], i["v"], i["lens2"])),
    ),
    (
        "AdditiveAttention, seed example",
        lambda r, i: _attention(
            r,
            r.module(r.am.AdditiveAttention, 2, 20, 8, 0.1, params=i["add_params"]),
            i["add_q"],
            i["seed_keys"],
            i["seed_values"],
            i["seed_lens"],
        ),
        lambda i: list(
            ref.additive_attention(
                i["add_params"], i["add_q"], i["seed_keys"], i["seed_values"], i["seed_lens"]
            )
        ),
    ),
    (
        "MultiHeadAttention, bias=False",
        lambda r, i: _mha(r, i, i["mha"]),
        lambda i: list(
            ref.multi_head_attention(i["mha"], i["mq"], i["mk"], i["mv"], i["m_lens"], 2)
        ),
    ),
    (
        "MultiHeadAttention, bias=True",
        lambda r, i: _mha(r, i, i["mha_bias"]),
        lambda i: list(
            ref.multi_head_attention(i["mha_bias"], i["mq"], i["mk"], i["mv"], i["m_lens"], 2)
        ),
    ),
    (
        "dot_product_attention, causal (bottom-right, Q < K)",
        lambda r, i: _forms(r, i, causal=True),
        lambda i: _ref_forms(i, causal=True),
    ),
    (
        "dot_product_attention, boolean mask (an empty row)",
        lambda r, i: _forms(r, i, mask=i["forms_mask"]),
        lambda i: _ref_forms(i, mask=i["forms_mask"]),
    ),
    (
        "dot_product_attention, bias (-inf entries)",
        lambda r, i: _forms(r, i, bias=i["forms_bias"]),
        lambda i: _ref_forms(i, bias=i["forms_bias"]),
    ),
    (
        "dot_product_attention, window (1, 0) and valid_lens",
        lambda r, i: _forms(r, i, valid_lens=i["m_lens"], window=(1, 0)),
        lambda i: _ref_forms(i, valid_lens=i["m_lens"], window=(1, 0)),
    ),
    (
        "MultiHeadAttention, GQA num_kv_heads=1, causal",
        lambda r, i: _gqa(r, i, causal=True),
        lambda i: _ref_gqa(i, causal=True),
    ),
    (
        "MultiHeadAttention, KV cache decoding",
        _decode,
        lambda i: _ref_gqa(i, steps=True, causal=True),
    ),
    (
        "dot_product_attention, mask_mod (documents, padding: an empty row)",
        lambda r, i: _forms(r, i, mask_mod=_documents(r.lens(i["doc_ids"]), 2)),
        lambda i: _ref_forms(i, mask_mod=_documents(i["doc_ids"], 2)),
    ),
    (
        "dot_product_attention, segment_ids (the same documents), causal",
        lambda r, i: _forms(r, i, segment_ids=i["doc_ids"], causal=True),
        lambda i: _ref_forms(i, segment_ids=i["doc_ids"], causal=True),
    ),
    (
        "dot_product_attention, score_mod (soft-capping 1.5), valid_lens",
        lambda r, i: _forms(r, i, score_mod=_softcap(r.B.tanh), valid_lens=i["m_lens"]),
        lambda i: _ref_forms(i, score_mod=_softcap(np.tanh), valid_lens=i["m_lens"]),
    ),
    (
        "MultiHeadAttention, GQA, score_mod (ALiBi), causal",
        lambda r, i: _gqa(r, i, score_mod=_alibi(r.a(i["alibi_slopes"]), r.B), causal=True),
        lambda i: _ref_gqa(i, score_mod=_alibi(i["alibi_slopes"]), causal=True),
    ),
    (
        "MultiHeadAttention, GQA, mask_mod (sliding window with a sink)",
        lambda r, i: _gqa(r, i, mask_mod=_sliding_window_with_sinks),
        lambda i: _ref_gqa(i, mask_mod=_sliding_window_with_sinks),
    ),
    (
        "PositionalEncoding",
        lambda r, i: [r.module(r.am.PositionalEncoding, 6, 0.0, max_len=50)(r.a(i["P_X"]))],
        lambda i: [ref.positional_encoding(i["P_X"])],
    ),
    (
        "nadaraya_watson",
        lambda r, i: list(
            r.am.nadaraya_watson(
                r.a(i["x_train"]), r.a(i["y_train"]), r.a(i["x_test"]), return_weights=True
            )
        ),
        lambda i: list(ref.nadaraya_watson(i["x_train"], i["y_train"], i["x_test"])),
    ),
    (
        "NWKernelRegression forward",
        lambda r, i: [
            r.module(r.am.NWKernelRegression, params={"w": i["nw_w"]})(
                r.a(i["x_train"]), r.a(i["nw_keys"]), r.a(i["nw_values"])
            )
        ],
        lambda i: [
            ref.nw_kernel_regression(i["nw_w"][0], i["x_train"], i["nw_keys"], i["nw_values"])
        ],
    ),
]
MECHANISMS = [name for name, _, _ in CASES]
RUNS = {name: run for name, run, _ in CASES}


def references(inputs):
    """{dtype: {mechanism: reference arrays}} for ``{dtype: rounded inputs}``."""
    return {
        dtype: {name: reference(inputs[dtype]) for name, _, reference in CASES} for dtype in inputs
    }


def compare(got, want, dtype):
    """(max abs error, passed) of backend results against the reference."""
    atol, rtol = TOLERANCES[dtype]
    if [g.shape for g in got] != [w.shape for w in want]:
        raise ValueError(
            f"shapes {[g.shape for g in got]} differ from the reference's {[w.shape for w in want]}"
        )
    err = max(
        float(np.max(np.abs(g.astype(np.float64) - w), initial=0.0)) for g, w in zip(got, want)
    )
    scale = max(float(np.max(np.abs(w), initial=0.0)) for w in want)
    return err, bool(err <= atol + rtol * scale)  # NaN fails
