"""JAX on its default device (the GPU on a GPU machine): ours under jit against
jax.nn.dot_product_attention, medians of interleaved runs (tests/gpu/run.sh)."""

import time

import gpu_timing  # (beside this script)
import jax
import jax.numpy as jnp
import numpy as np

import attention_multi as am

print("jax", jax.__version__, jax.devices(), flush=True)
small = jax.devices()[0].platform == "cpu"


def row(title, fns, base):
    gpu_timing.row(title, fns, base, jax.block_until_ready)


def theirs(q, k, v, **kw):  # (jax's layout is (B, T, N, H))
    q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
    return jax.nn.dot_product_attention(q, k, v, **kw).swapaxes(1, 2)


B, T, H, D = (16, 512, 8, 64) if not small else (2, 64, 2, 16)
rng = np.random.default_rng(0)


def padding_and_causal(dtype):
    q, k, v = (jnp.asarray(rng.normal(size=(B, H, T, D)), dtype) for _ in range(3))
    lens = jnp.asarray(rng.integers(T // 4, T + 1, B), jnp.int32)
    ours = jax.jit(lambda q, k, v, lens: am.dot_product_attention(q, k, v, valid_lens=lens))
    jax_lens = jax.jit(lambda q, k, v, lens: theirs(q, k, v, key_value_seq_lengths=lens))
    diff = ours(q, k, v, lens).astype(jnp.float32) - jax_lens(q, k, v, lens).astype(jnp.float32)
    print(f"  max |ours - jax| {dtype.__name__}: {float(jnp.max(jnp.abs(diff))):.2e}")
    row(
        f"jit valid_lens B={B} H={H} T={T} d={D} {dtype.__name__}",
        {"ours": lambda: ours(q, k, v, lens), "jax.nn": lambda: jax_lens(q, k, v, lens)},
        "jax.nn",
    )
    causal = jax.jit(lambda q, k, v: am.dot_product_attention(q, k, v, causal=True))
    jax_causal = jax.jit(lambda q, k, v: theirs(q, k, v, is_causal=True))
    row(
        f"jit causal {dtype.__name__}",
        {"ours": lambda: causal(q, k, v), "jax.nn": lambda: jax_causal(q, k, v)},
        "jax.nn",
    )
    if dtype == jnp.bfloat16 and not small:
        cudnn = jax.jit(lambda q, k, v: theirs(q, k, v, is_causal=True, implementation="cudnn"))
        row(
            "jit causal bf16 vs cudnn",
            {"ours": lambda: causal(q, k, v), "cudnn": lambda: cudnn(q, k, v)},
            "cudnn",
        )


def block_sparse():
    """Segment ids with causal under jit: the compile, then a call (B=4, T=4096)."""
    Bs, Ts = (4, 4096) if not small else (2, 512)
    q = jnp.asarray(rng.normal(size=(Bs, 2, Ts, 32)), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, 8, (Bs, Ts)), axis=1), jnp.int32)
    f = jax.jit(lambda q, ids: am.dot_product_attention(q, q, q, segment_ids=ids, causal=True))
    t = time.perf_counter()
    jax.block_until_ready(f(q, ids))
    compiled = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(f(q, ids))
    once = time.perf_counter() - t
    print(
        f"jit segment_ids+causal B={Bs} T={Ts}: compile {compiled:.2f} s, call {once * 1e3:.2f} ms"
    )


for dtype in (jnp.float32, jnp.bfloat16):
    padding_and_causal(dtype)
block_sparse()
