"""The integrations table: ours inside the models people run.

- A transformers Llama-style model (``attn_implementation=register()``),
  B=4, T=512 and 1024, padded (right padding, lengths uniform in [T/4, T]),
  float32, forward and forward+backward, against transformers' ``sdpa`` and
  ``eager``; and the attention call alone (one layer's query, key and value,
  with the mask each implementation's mask function makes), against ``sdpa``.
- A flax nnx ``MultiHeadAttention`` under ``jax.jit(jax.grad)`` with a
  padding mask, ``attention_fn=`` ours against flax's default.

Targets: model forward+backward / sdpa <= 0.9x; the call alone / sdpa <= 0.7x;
flax jit(grad) / flax's default <= 1.05x.
"""

import copy

import numpy as np

from .timing import compare, random_lens

INTEGRATIONS = {"batch": 4, "lengths": (512, 1024), "hidden": 256, "heads": 8, "kv_heads": 4}
TARGETS = {"model train": 0.9, "attention call": 0.7, "flax jit(grad)": 1.05}


def run_integrations(seconds, lengths=None):
    """Rows: dicts of what was measured, against what, its shape, both
    medians, their ratio and the target (None: no target)."""
    rows = []
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        for t in lengths or INTEGRATIONS["lengths"]:
            rows += _transformers_rows(t, seconds)
    try:
        import flax  # noqa: F401
    except ImportError:
        pass
    else:
        rows += _flax_rows(seconds)
    return rows


def _transformers_rows(length, seconds):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, masking_utils
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ...integrations import transformers as amt

    p, B = INTEGRATIONS, INTEGRATIONS["batch"]
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=p["hidden"],
        intermediate_size=2 * p["hidden"],
        num_hidden_layers=2,
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=length,
    )
    torch.manual_seed(0)
    models = {}
    for impl in (amt.register(), "sdpa", "eager"):
        models[impl] = AutoModelForCausalLM.from_config(
            copy.deepcopy(cfg), attn_implementation=impl
        )
        models[impl].load_state_dict(models[amt.DEFAULT_NAME].state_dict())
    ids = torch.randint(3, 1000, (B, length), generator=torch.Generator().manual_seed(0))
    lens = torch.from_numpy(random_lens(B, length).astype(np.int64))
    mask = (torch.arange(length) < lens[:, None]).long()
    keep = mask.bool()
    shape = f"B={B} T={length}"
    rows = []

    def forward(impl):
        model = models[impl].eval()
        return lambda: model(ids, attention_mask=mask).logits

    def train(impl):
        model = models[impl].train()

        def step():
            model.zero_grad(set_to_none=True)
            logits = model(ids, attention_mask=mask).logits
            logits[keep].square().mean().backward()
            return logits

        return step

    with torch.no_grad():
        for base in ("sdpa", "eager"):
            rows.append(
                _row(
                    "model forward", base, shape, forward(amt.DEFAULT_NAME), forward(base), seconds
                )
            )
    for base in ("sdpa", "eager"):
        rows.append(_row("model train", base, shape, train(amt.DEFAULT_NAME), train(base), seconds))
    # the attention call alone: one layer's arrays, each implementation's own mask
    d = p["hidden"] // p["heads"]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, p["heads"], length, d, generator=g)
    k, v = (torch.randn(B, p["kv_heads"], length, d, generator=g) for _ in range(2))
    module = models["sdpa"].model.layers[0].self_attn
    sizes = dict(batch_size=B, q_length=length, kv_length=length, attention_mask=keep)
    ours_mask = amt.mask_function(**sizes)
    their_mask = masking_utils.sdpa_mask(**sizes)
    with torch.no_grad():
        rows.append(
            _row(
                "attention call",
                "sdpa",
                shape,
                lambda: amt.attention_function(module, q, k, v, ours_mask, scaling=d**-0.5)[0],
                lambda: sdpa_attention_forward(module, q, k, v, their_mask, scaling=d**-0.5)[0],
                seconds,
            )
        )
    return rows


def _flax_rows(seconds):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ...integrations import flax as amf

    B, T, H = 4, 512, 8
    lens = jnp.asarray(random_lens(B, T))
    real = jnp.arange(T) < lens[:, None]
    mask = nnx.make_attention_mask(real, real)
    x = jax.random.normal(jax.random.key(0), (B, T, 256))

    def grad_of(fn):
        layer = nnx.MultiHeadAttention(
            num_heads=H, in_features=256, decode=False, attention_fn=fn, rngs=nnx.Rngs(0)
        )
        graph, state = nnx.split(layer)

        def loss(state, x):
            out = nnx.merge(graph, state)(x, mask=mask)
            return jnp.sum(jnp.where(real[..., None], out, 0) ** 2)

        step = jax.jit(jax.grad(loss))
        return lambda: step(state, x)

    def sync(tree):
        return jax.block_until_ready(tree)

    return [
        _row(
            "flax jit(grad)",
            "flax default",
            f"B={B} T={T} H={H}",
            grad_of(amf.dot_product_attention),
            grad_of(nnx.dot_product_attention),
            seconds,
            sync,
        )
    ]


def _row(what, against, shape, ours, theirs, seconds, sync=lambda x: x):
    t_ours, t_theirs, _ = compare(ours, theirs, seconds, sync)
    target = TARGETS.get(what) if against in ("sdpa", "flax default") else None
    ratio = t_ours / t_theirs
    return {
        "measured": what,
        "against": against,
        "shape": shape,
        "ours_s": t_ours,
        "theirs_s": t_theirs,
        "ratio": ratio,
        "target": target,
        "met": None if target is None else ratio <= target,
    }


def with_busy(rows, busy_rows):
    """``rows`` with each row's ratio beside one busy process (``busy_ratio``)."""
    busy = {(r["measured"], r["against"], r["shape"]): r["ratio"] for r in busy_rows}
    return [dict(r, busy_ratio=busy.get((r["measured"], r["against"], r["shape"]))) for r in rows]


def integrations_table(rows):
    """Markdown: each row's medians and ratio, idle (and busy), and its target."""
    lines = [
        "| Measured | Against | Shape | Ours | Theirs | Ratio | Busy ratio | Target |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        busy = r.get("busy_ratio")
        target = "-" if r["target"] is None else f"≤ {r['target']:.2f}x"
        if r["target"] is not None:
            met = r["ratio"] <= r["target"] and (busy is None or busy <= r["target"])
            target += " yes" if met else " NO"
        lines.append(
            f"| {r['measured']} | {r['against']} | {r['shape']} | {r['ours_s'] * 1e3:.1f} ms "
            f"| {r['theirs_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x "
            f"| {'–' if busy is None else f'{busy:.2f}x'} | {target} |"
        )
    return "\n".join(lines)
