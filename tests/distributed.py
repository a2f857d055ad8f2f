"""Workers of the distributed tests (test_distributed.py), run as processes:

    python tests/distributed.py torch RANK SIZE PORT OUT_DIR JOBS
    python tests/distributed.py jax DEVICES OUT_DIR JOBS

Each writes its results as ``OUT_DIR/<job>-<rank>.npz``; the tests compare
them with one process. Inputs are drawn from fixed NumPy seeds, so the test
process can draw the same ones.
"""

import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ring attention cases: name -> (keyword arguments, 2-D lengths); shards of
# Q_SHARD queries and K_SHARD keys, or ZIGZAG_SHARD of each where a case
# names a layout (zigzag cuts each shard into two chunks); "segment_ids",
# "mask_mod" and "score_mod" stand for SEGMENTS, MASK_MOD and SCORE_MOD
BATCH, HEADS, Q_SHARD, K_SHARD, D = 2, 2, 3, 4, 8
ZIGZAG_SHARD = (4, 6)
RING_CASES = {
    "plain": ({}, False),
    "lens": ({}, False),
    "lens2d": ({}, True),
    "causal": ({"causal": True}, False),
    "causal_lens": ({"causal": True}, False),
    "window": ({"window": (3, 1)}, False),
    # a budget of one query's scores: the steps go a query at a time
    "chunks": ({"causal": True, "memory_budget": 16 * BATCH * HEADS * K_SHARD * 8}, True),
    "zigzag_causal": ({"causal": True, "layout": "zigzag"}, False),
    "zigzag_lens2d_window": ({"window": (5, 0), "layout": "zigzag"}, True),
    "zigzag_chunks": (
        {"causal": True, "layout": "zigzag", "memory_budget": 16 * BATCH * HEADS * 6 * 8},
        False,
    ),
    "packed": ({"causal": True, "segment_ids": True, "layout": "contiguous"}, False),
    "zigzag_packed": ({"causal": True, "segment_ids": True, "layout": "zigzag"}, False),
    "zigzag_mods": ({"mask_mod": True, "score_mod": True, "layout": "zigzag"}, False),
}

# JAX compiles each case (a few seconds, three times that for a zigzag one):
# the layouts and forms at 2 devices, the first cases and zigzag at 4
JAX_RING_CASES = {
    2: [
        n for n in RING_CASES if n not in ("zigzag_chunks", "zigzag_lens2d_window", "zigzag_packed")
    ],
    4: [n for n in RING_CASES if not n.startswith(("zigzag", "packed")) or n == "zigzag_causal"],
}


def MASK_MOD(b, h, q_idx, kv_idx):  # noqa: N802 (a keyword's stand-in)
    """Every third key of each query hidden, and none past it by more than 5."""
    return ((q_idx + kv_idx) % 3 != 0) & (kv_idx <= q_idx + 5)


def SCORE_MOD(score, b, h, q_idx, kv_idx):  # noqa: N802
    """Integer terms: exact in every float dtype."""
    return score + (q_idx % 2) - (kv_idx % 3) + h


def ring_shards(name):
    """(queries, keys) per participant of a case."""
    return ZIGZAG_SHARD if "layout" in RING_CASES[name][0] else (Q_SHARD, K_SHARD)


def ring_kwargs(name, size, backend=None):
    """The keyword arguments of a case, stand-ins replaced."""
    kwargs = dict(RING_CASES[name][0])
    if kwargs.get("segment_ids"):
        kwargs["segment_ids"] = segments(name, size)
    if kwargs.get("mask_mod"):
        kwargs["mask_mod"] = MASK_MOD
    if kwargs.get("score_mod"):
        kwargs["score_mod"] = SCORE_MOD
    return kwargs


def segments(name, size):
    """(batch, P K) document ids: documents of 1 to 2 K positions, the tail padding."""
    rng = np.random.default_rng(sorted(RING_CASES).index(name) + 100 * size)
    num_k = size * ring_shards(name)[1]
    ids = np.full((BATCH, num_k), -1, np.int64)
    for b in range(BATCH):
        at, doc = 0, 0
        while at < num_k - 2:
            n = int(rng.integers(1, 2 * ring_shards(name)[1] + 1))
            ids[b, at : at + n] = doc
            at, doc = at + n, doc + 1
    return ids


def ring_inputs(name, size):
    """Whole-sequence float64 inputs of a ring case: q (b, h, P Q, d), k, v
    (b, h, P K, d), the output's cotangent, and valid_lens (None, (b,) or
    (b, P Q))."""
    rng = np.random.default_rng(sorted(RING_CASES).index(name) + 10 * size)
    q_shard, k_shard = ring_shards(name)
    num_q, num_k = size * q_shard, size * k_shard
    q = rng.standard_normal((BATCH, HEADS, num_q, D))
    k = rng.standard_normal((BATCH, HEADS, num_k, D))
    v = rng.standard_normal((BATCH, HEADS, num_k, D))
    g = rng.standard_normal((BATCH, HEADS, num_q, D))
    lens = None
    if name in ("lens", "causal_lens"):
        lens = np.array([num_k - k_shard - 1, 2])  # whole blocks unseen too
    elif RING_CASES[name][1]:
        lens = rng.integers(0, num_k + 1, (BATCH, num_q))
        lens[0, 0] = 0  # a query that sees nothing
    return q, k, v, g, lens


MHA = dict(key_size=6, query_size=6, value_size=6, num_hiddens=8, num_heads=2)
TRAIN_BATCH, TRAIN_LEN, TRAIN_STEPS, TRAIN_LR = 4, 5, 3, 0.5


def train_data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((TRAIN_BATCH, TRAIN_LEN, MHA["query_size"]))
    y = rng.standard_normal((TRAIN_BATCH, TRAIN_LEN, MHA["num_hiddens"]))
    lens = np.array([2, 5, 3, 4])
    return x, y, lens


def initial_params():
    """Float64 parameters of the trained MultiHeadAttention, by name."""
    rng = np.random.default_rng(8)
    h = MHA["num_hiddens"]
    return {
        f"W_{n}.weight": rng.uniform(-0.4, 0.4, (h, MHA[s] if n != "o" else h))
        for n, s in (
            ("q", "query_size"),
            ("k", "key_size"),
            ("v", "value_size"),
            ("o", "num_hiddens"),
        )
    }


def torch_model():
    import attention_multi as am

    net = am.MultiHeadAttention(**MHA, dropout=0.0, backend="torch", dtype="float64")
    am.set_params(net, initial_params())
    return net.eval()


def torch_train(net, x, y, lens, steps=TRAIN_STEPS):
    """SGD on the mean squared error; returns the losses."""
    import torch

    opt = torch.optim.SGD(net.parameters(), lr=TRAIN_LR)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((net(x, x, x, lens) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def torch_worker(rank, size, port, out_dir, jobs):
    import torch
    import torch.distributed as dist

    import attention_multi as am

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        for job in jobs:
            result = {}
            if job == "ring":
                for name in RING_CASES:
                    kwargs = ring_kwargs(name, size)
                    layout = kwargs.get("layout", "contiguous")
                    q, k, v, g, lens = ring_inputs(name, size)
                    qs, ks, vs, gs = (
                        am.ring_shard(torch.tensor(x), rank, size, layout=layout).requires_grad_()
                        for x in (q, k, v, g)
                    )
                    if lens is not None and lens.ndim == 2:
                        lens = am.ring_shard(lens, rank, size, layout=layout, axis=-1)
                    log = []
                    res = am.ring_attention(
                        qs,
                        ks,
                        vs,
                        None if lens is None else torch.tensor(lens),
                        step_log=log,
                        **kwargs,
                    )
                    (res * gs).sum().backward()
                    for key, x in (("out", res), ("dq", qs.grad), ("dk", ks.grad), ("dv", vs.grad)):
                        result[f"{name}.{key}"] = x.detach().numpy()
                    result[f"{name}.scores"] = np.array([s["scores"] for s in log])
                    result[f"{name}.calls"] = np.array([s["calls"] for s in log])
            elif job in ("ddp", "fsdp"):
                x, y, lens = train_data()
                part = slice(rank * TRAIN_BATCH // size, (rank + 1) * TRAIN_BATCH // size)
                net = torch_model()
                if job == "ddp":
                    model = torch.nn.parallel.DistributedDataParallel(net)
                else:
                    from torch.distributed.fsdp import fully_shard

                    model = fully_shard(net)
                losses = torch_train(
                    model, torch.tensor(x[part]), torch.tensor(y[part]), torch.tensor(lens[part])
                )
                result["losses"] = np.array(losses)
                for name, p in net.named_parameters():
                    if hasattr(p, "full_tensor"):  # FSDP2: a sharded DTensor
                        p = p.full_tensor()
                    result[name] = p.detach().numpy()
            np.savez(os.path.join(out_dir, f"{job}-{rank}.npz"), **result)
    except BaseException:  # the peers would wait for this one forever
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (torch 2.13 CPU workers that ran SDPA may abort at teardown)


def jax_worker(devices, out_dir, jobs):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import attention_multi as am

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.7
        from jax.experimental.shard_map import shard_map
    assert len(jax.devices()) == devices, jax.devices()
    for job in jobs:
        result = {}
        if job == "ring":
            mesh = Mesh(np.array(jax.devices()), ("seq",))
            for name in JAX_RING_CASES[devices]:
                kwargs = ring_kwargs(name, devices)
                layout = kwargs.get("layout", "contiguous")
                q, k, v, g, lens = ring_inputs(name, devices)
                ids = kwargs.pop("segment_ids", None)
                if lens is not None and lens.ndim == 2:
                    lens = am.ring_order(lens, devices, layout=layout, axis=-1)
                # ("packed": a pair, the queries' ids traced, the keys' NumPy ids closed over)
                given = ids if name != "packed" else ids[:, ids.shape[1] - q.shape[2] :]
                extra = tuple(jnp.asarray(x) for x in (lens, given) if x is not None)
                extra_specs = tuple(
                    P(None, "seq") if x.ndim == 2 and x is lens else P()
                    for x in (lens, given)
                    if x is not None
                )

                def attention(q, k, v, *extra, kwargs=kwargs, lens=lens, ids=ids, name=name):
                    extra = list(extra)
                    lens_ = extra.pop(0) if lens is not None else None
                    forms = kwargs
                    if ids is not None:
                        held = extra.pop(0)
                        forms = dict(kwargs, segment_ids=(held, ids) if name == "packed" else held)
                    return am.ring_attention(q, k, v, lens_, axis_name="seq", **forms)

                spec = P(None, None, "seq")
                ring = shard_map(
                    attention,
                    mesh=mesh,
                    in_specs=(spec, spec, spec) + extra_specs,
                    out_specs=spec,
                )
                ordered = [am.ring_order(x, devices, layout=layout) for x in (q, k, v, g)]

                def loss(q, k, v, ring=ring, extra=extra, g=ordered[3]):
                    out = ring(q, k, v, *extra)
                    return (out * g).sum(), out

                (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
                    *ordered[:3]
                )
                for key, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
                    result[f"{name}.{key}"] = am.ring_gather(
                        np.asarray(x), layout=layout, world=devices
                    )
        elif job == "mesh":
            # batch over "data", heads (the projections' output features) over "model"
            mesh = Mesh(np.array(jax.devices()).reshape(2, devices // 2), ("data", "model"))
            x, y, lens = train_data()
            net = am.MultiHeadAttention(**MHA, dropout=0.0, backend="jax", dtype="float64").eval()
            am.set_params(net, initial_params())

            def loss(net, x, y, lens):
                return ((net(x, x, x, lens) - y) ** 2).mean()

            @jax.jit
            def sgd(net, x, y, lens):
                value, grads = jax.value_and_grad(loss)(net, x, y, lens)
                return jax.tree_util.tree_map(lambda w, dw: w - TRAIN_LR * dw, net, grads), value

            def place(net, mesh=mesh):
                data = NamedSharding(mesh, P("data"))
                rows = NamedSharding(mesh, P("model", None))
                cols = NamedSharding(mesh, P(None, "model"))
                for name in ("W_q", "W_k", "W_v"):
                    child = getattr(net, name)
                    object.__setattr__(child, "weight", jax.device_put(child.weight, rows))
                object.__setattr__(net.W_o, "weight", jax.device_put(net.W_o.weight, cols))
                return data

            data = place(net)
            xs, ys, ls = (jax.device_put(jnp.asarray(a), data) for a in (x, y, lens))
            losses = []
            for _ in range(TRAIN_STEPS):
                net, value = sgd(net, xs, ys, ls)
                losses.append(float(value))
            result["losses"] = np.array(losses)
            result["out_sharding"] = np.array(str(net.W_q.weight.sharding.spec))
            for name, p in am.get_params(net).items():
                result[name] = p
        np.savez(os.path.join(out_dir, f"{job}-jax{devices}.npz"), **result)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    kind = sys.argv[1]
    if kind == "torch":
        rank, size, port = (int(a) for a in sys.argv[2:5])
        torch_worker(rank, size, port, sys.argv[5], sys.argv[6].split(","))
    else:
        jax_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4].split(","))
