"""Empty inputs: batch 0, no queries, no keys, no rows, on every mechanism,
backend and path. Results have the right shape and are zero where a query
has no key; gradients are zero or empty, never NaN.

MXNet 1.9.1 crashed the interpreter on some zero-size arrays (a segfault in
masked_softmax with no keys, an abort with batch 0), so each backend's cases
run in a subprocess, where a crash fails the test instead of the run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import attention_multi as am
from attention_multi.backends.capabilities import Autodiff, opt, supports

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("fused", "tiled", "chunked", "full")
EMPTY = {"batch": (0, 3, 4), "queries": (2, 0, 4), "keys": (2, 3, 0)}  # (b, Q, K)


def _arr(B, shape):
    return B.asarray(np.ones(shape, np.float32), "float32")


def _attention_case(B, kind, axis, path):
    b, nq, nk = EMPTY[axis]
    q, k, v = _arr(B, (b, nq, 6)), _arr(B, (b, nk, 6)), _arr(B, (b, nk, 5))
    lens = B.asarray(np.full((b,), 1, np.int32))
    if kind == "dot":
        m = am.DotProductAttention(0.0, backend=B, path=path)
        want, weights = (b, nq, 5), (b, nq, nk)
    elif kind == "multi_head":
        m = am.MultiHeadAttention(6, 6, 5, 8, 2, 0.0, backend=B, path=path)
        want, weights = (b, nq, 8), (2 * b, nq, nk)
    else:
        m = am.AdditiveAttention(6, 6, 7, 0.0, backend=B)
        want, weights = (b, nq, 5), (b, nq, nk)
    m.eval()
    out = m(q, k, v, lens)
    return out, want, m.attention_weights, weights, (m, (q, k, v), lens)


def _functional_case(B, name, axis):
    b, nq, nk = EMPTY[axis]
    if name == "masked_softmax":
        X = _arr(B, (b, nq, nk))
        return am.masked_softmax(X, np.full((b,), 1)), (b, nq, nk)
    if name == "sequence_mask":
        rows, cols = (0, 4) if axis == "batch" else (3, 0) if axis == "keys" else (2, 3)
        return am.sequence_mask(_arr(B, (rows, cols)), np.zeros(rows, np.int32)), (rows, cols)
    if name == "dot_product_attention":
        q, k, v = _arr(B, (b, 2, nq, 4)), _arr(B, (b, 1, nk, 4)), _arr(B, (b, 1, nk, 3))
        return am.dot_product_attention(q, k, v, causal=True), (b, 2, nq, 3)
    if name == "no_heads":  # (an empty heads axis, as the others)
        q, k, v = _arr(B, (b, 0, nq, 4)), _arr(B, (b, 0, nk, 4)), _arr(B, (b, 0, nk, 3))
        return am.dot_product_attention(q, k, v, causal=True), (b, 0, nq, 3)
    if name == "transpose_qkv":
        return am.transpose_qkv(_arr(B, (b, nq, 6)), 2), (2 * b, nq, 3)
    if name == "transpose_output":
        return am.transpose_output(_arr(B, (2 * b, nq, 3)), 2), (b, nq, 6)
    if name == "positional_encoding":
        pe = am.PositionalEncoding(6, 0.1, backend=B)  # training mode: dropout on
        return pe(_arr(B, (b, nq, 6)), key=opt(B).dropout_key(0)), (b, nq, 6)
    if name == "nadaraya_watson":
        x_train, x_query = _arr(B, (nk,)), _arr(B, (nq,))
        return am.nadaraya_watson(x_train, x_train, x_query), (nq,)
    if name == "nw_kernel_regression":
        n, m = (nq, nk) if axis != "batch" else (0, 3)
        net = am.NWKernelRegression(backend=B)
        return net(_arr(B, (n,)), _arr(B, (n, m)), _arr(B, (n, m))), (n,)
    raise KeyError(name)


FUNCTIONS = (
    "masked_softmax",
    "sequence_mask",
    "dot_product_attention",
    "no_heads",
    "transpose_qkv",
    "transpose_output",
    "positional_encoding",
    "nadaraya_watson",
    "nw_kernel_regression",
)
MODULE_CASES = [(kind, path) for kind in ("dot", "multi_head") for path in PATHS] + [
    ("additive", "full")
]


def run_cases(backend_name):
    """Every case on one backend: ``{case: [shape, want, zero, finite, grads ok]}``."""
    B = am.get_backend(backend_name)
    results = {}
    for axis in EMPTY:
        for kind, path in MODULE_CASES:
            out, want, w, want_w, (m, inputs, lens) = _attention_case(B, kind, axis, path)
            got = B.to_numpy(out)
            grads_ok = True
            if supports(B, Autodiff):

                def loss_fn(module, *xs, lens=lens):
                    y = module(*xs, lens)
                    return B.sum(y.reshape((int(np.prod(tuple(y.shape))),)), 0)

                _, g_params, g_inputs = B.gradients(loss_fn, m, *inputs)
                grads = [g for g in list(g_params.values()) + list(g_inputs) if g is not None]
                grads_ok = all(np.isfinite(B.to_numpy(g)).all() for g in grads)
            results[f"{kind}/{path}/{axis}"] = [
                list(got.shape),
                list(want),
                bool((got == 0).all()),
                [list(B.to_numpy(w).shape), list(want_w)],
                grads_ok,
                m.last_path,
            ]
        for name in FUNCTIONS:
            out, want = _functional_case(B, name, axis)
            got = B.to_numpy(out)
            # zero unless the case is not empty for this function (its rows see keys)
            nonempty_result = name in (
                "transpose_qkv",
                "transpose_output",
                "positional_encoding",
            ) or (name == "nadaraya_watson" and axis == "batch")
            zero = nonempty_result or bool((got == 0).all())
            results[f"{name}/{axis}"] = [list(got.shape), list(want), zero, None, True, None]
    return results


def _check(results):
    bad = {
        case: r
        for case, r in results.items()
        if r[0] != r[1]
        or not r[2]
        or (r[3] is not None and r[3][0] != r[3][1])
        or not r[4]
        or (r[5] is not None and r[5] != "empty")
    }
    assert not bad, bad
    assert len(results) == 3 * (len(MODULE_CASES) + len(FUNCTIONS))


def test_empty_inputs(backend):
    """In a subprocess per backend, so that an interpreter crash fails the test."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    code = (
        "import json\nfrom tests.test_empty import run_cases\n"
        f"print('RESULTS' + json.dumps(run_cases({backend.name!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS"))
    _check(json.loads(line[len("RESULTS") :]))
