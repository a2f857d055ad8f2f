"""Distributed engines and ring attention, against one process.

torch: 2 and 4 CPU processes with gloo (``tests/distributed.py`` workers);
JAX: 2 and 4 simulated host devices (``--xla_force_host_platform_device_count``)
in a subprocess. All in float64, so agreement is to rounding.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from attention_multi.testing import assert_close
from tests import distributed as D

WORKER = os.path.join(D.REPO, "tests", "distributed.py")
TIMEOUT = 1200
TOL = dict(rtol=1e-9, atol=1e-10)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([D.REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def run_torch(tmp_path, size, jobs):
    """Results of ``size`` torch worker processes: {job: [per rank dict]}."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                "torch",
                str(r),
                str(size),
                str(port),
                str(tmp_path),
                ",".join(jobs),
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(size)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return {job: [_load(tmp_path / f"{job}-{r}.npz") for r in range(size)] for job in jobs}


def run_jax(tmp_path, devices, jobs):
    result = subprocess.run(
        [sys.executable, WORKER, "jax", str(devices), str(tmp_path), ",".join(jobs)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {job: _load(tmp_path / f"{job}-jax{devices}.npz") for job in jobs}


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    pytest.importorskip("torch")
    return {
        2: run_torch(tmp_path_factory.mktemp("torch2"), 2, ["ring", "ddp", "fsdp"]),
        4: run_torch(tmp_path_factory.mktemp("torch4"), 4, ["ring"]),
    }


@pytest.fixture(scope="module")
def jax_runs(tmp_path_factory):
    pytest.importorskip("jax")
    return {
        2: run_jax(tmp_path_factory.mktemp("jax2"), 2, ["ring"]),
        4: run_jax(tmp_path_factory.mktemp("jax4"), 4, ["ring", "mesh"]),
    }


def ring_expected(name, size):
    """Output and input gradients of one process's attention on the whole
    sequence (torch autograd in float64)."""
    import torch

    import attention_multi as am

    q, k, v, g, lens = D.ring_inputs(name, size)
    kwargs = D.ring_kwargs(name, size)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("memory_budget", "layout")}
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = am.dot_product_attention(q, k, v, None if lens is None else torch.tensor(lens), **kwargs)
    (out * torch.tensor(g)).sum().backward()
    return {
        key: x.detach().numpy()
        for key, x in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))
    }


def ring_oracle(name, size):
    """The float64 oracle's output and gradients on the whole sequence."""
    from attention_multi import reference

    q, k, v, g, lens = D.ring_inputs(name, size)
    kwargs = D.ring_kwargs(name, size)
    forms = {k: v for k, v in kwargs.items() if k not in ("memory_budget", "layout")}
    out, _ = reference.attention(q, k, v, lens, **forms)
    if "score_mod" in forms:  # (its derivative: 1, the terms added are constants)
        forms["score_mod_derivative"] = lambda s, *_: np.ones_like(s)
    dq, dk, dv, _ = reference.attention_gradients(q, k, v, g, lens, **forms)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def _gather(parts, key, name):
    """The whole sequence from the parts of all ranks, in the case's layout."""
    import attention_multi as am

    layout = D.RING_CASES[name][0].get("layout", "contiguous")
    return am.ring_gather([p[f"{name}.{key}"] for p in parts], layout=layout)


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(D.RING_CASES))
def test_torch_ring_attention_equals_one_process(torch_runs, name, size):
    parts = torch_runs[size]["ring"]
    expected, oracle = ring_expected(name, size), ring_oracle(name, size)
    for key in ("out", "dq", "dk", "dv"):
        assert_close(_gather(parts, key, name), oracle[key], **TOL)
        assert_close(_gather(parts, key, name), expected[key], **TOL)


@pytest.mark.slow
@pytest.mark.second_stack
@pytest.mark.parametrize(
    "name, size", [(n, size) for size, names in D.JAX_RING_CASES.items() for n in names]
)
def test_jax_ring_attention_equals_one_device(jax_runs, name, size):
    got = jax_runs[size]["ring"]
    expected, oracle = ring_expected(name, size), ring_oracle(name, size)
    for key in ("out", "dq", "dk", "dv"):
        assert_close(got[f"{name}.{key}"], oracle[key], **TOL)
        assert_close(got[f"{name}.{key}"], expected[key], **TOL)


def ring_step_scores(name, size, rank):
    """Per step, for participant ``rank``: the scores its queries may see
    among the keys it holds (the oracle's mask), and those of the pairs of a
    chunk of its queries and a chunk of keys where one query sees one key."""
    import attention_multi as am
    from attention_multi import reference

    layout = D.RING_CASES[name][0].get("layout", "contiguous")
    q_shard, k_shard = D.ring_shards(name)
    n = 2 if layout == "zigzag" else 1
    seen = reference.allowed_keys(1, 1, size * q_shard, size * k_shard, causal=True)[0, 0]
    index = np.arange(size * 2 * n).reshape(1, -1)  # (the chunks' numbers, in parts)
    mine = am.ring_shard(index, rank, size, layout=layout, axis=-1)[0][::2] // 2
    cq, ck = q_shard // n, k_shard // n
    visible, chunks = [], []
    for step in range(size):
        theirs = am.ring_shard(index, (rank - step) % size, size, layout=layout, axis=-1)
        pairs = [
            seen[a * cq : (a + 1) * cq, b * ck : (b + 1) * ck].sum()
            for a in mine
            for b in theirs[0][::2] // 2
        ]
        visible.append(D.BATCH * D.HEADS * sum(pairs))
        chunks.append(D.BATCH * D.HEADS * cq * ck * sum(1 for p in pairs if p))
    return np.array(visible), np.array(chunks)


@pytest.mark.parametrize("name", ["causal", "zigzag_causal"])
def test_torch_ring_skips_unseen_chunks_and_balances_zigzag(torch_runs, name):
    """Causal over 4 participants: each computes at least the scores its
    queries may see and at most the chunks where one of them sees a key; a
    step with none makes no kernel call. Contiguous, the last participant
    computes twice the first; zigzag, none more than 1.1 times the mean."""
    parts = torch_runs[4]["ring"]
    totals = []
    for rank, part in enumerate(parts):
        visible, chunks = ring_step_scores(name, 4, rank)
        scores = part[f"{name}.scores"]
        assert (visible <= scores).all() and (scores <= chunks).all(), (scores, visible, chunks)
        assert ((part[f"{name}.calls"] == 0) == (visible == 0)).all()
        totals.append(scores.sum())
    if name == "zigzag_causal":
        assert max(totals) <= 1.1 * np.mean(totals), totals
    else:
        assert totals[-1] >= 2 * totals[0], totals


def one_process_training():
    import torch

    x, y, lens = D.train_data()
    net = D.torch_model()
    losses = D.torch_train(net, torch.tensor(x), torch.tensor(y), torch.tensor(lens))
    return losses, {n: p.detach().numpy() for n, p in net.named_parameters()}


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_torch_data_parallel_equals_one_process(torch_runs, engine):
    """DDP and FSDP2 (``fully_shard``) over 2 gloo processes, each on half of
    the batch, end with the parameters of one process on the whole batch."""
    losses, params = one_process_training()
    ranks = torch_runs[2][engine]
    # each rank's loss is the mean over its half: their mean is the whole batch's
    assert_close(np.mean([r["losses"] for r in ranks], axis=0), np.array(losses), **TOL)
    for rank in ranks:
        for name, value in params.items():
            assert_close(rank[name], value, **TOL)
    assert not np.allclose(params["W_q.weight"], D.initial_params()["W_q.weight"])


@pytest.mark.second_stack
def test_jax_mesh_sharding_equals_one_device(jax_runs):
    """MultiHeadAttention trained under jax.jit with the batch sharded over
    "data" and the heads over "model" (a 2x2 mesh) equals one device."""
    import torch

    got = jax_runs[4]["mesh"]
    assert "model" in str(got["out_sharding"])
    losses, params = one_process_training()
    assert_close(got["losses"], np.array(losses), **TOL)
    for name, value in params.items():
        assert_close(got[name], value, **TOL)
    del torch


def test_ring_attention_needs_a_communicating_backend():
    import attention_multi as am

    x = np.ones((1, 4, 2))
    with pytest.raises(NotImplementedError, match="numpy backend has none"):
        am.ring_attention(x, x, x)
    torch = pytest.importorskip("torch")
    t = torch.ones(1, 4, 2)
    with pytest.raises(ValueError, match="init_process_group"):
        am.ring_attention(t, t, t)
    jnp = pytest.importorskip("jax.numpy")
    j = jnp.ones((1, 4, 2))
    with pytest.raises(ValueError, match="pass axis_name="):
        am.ring_attention(j, j, j)
    with pytest.raises(ValueError, match="batch sizes differ"):  # shapes checked first
        am.ring_attention(t, t[:0], t)
    # (what it does not take is named with the keywords it does)
    taken = "valid_lens, causal, window, mask_mod, score_mod, segment_ids"
    with pytest.raises(TypeError, match=rf"argument 'sinks' \(the mask keywords: {taken}\)$"):
        am.ring_attention(t, t, t, sinks=t)
    with pytest.raises(ValueError, match="not mask="):
        am.ring_attention(t, t, t, mask=t > 0)


def test_ring_shard_refuses_a_rank_outside_the_world():
    """A rank at or past ``world`` is refused (it gave an empty part)."""
    import attention_multi as am

    x = np.zeros((1, 2, 8, 4))
    assert am.ring_shard(x, 1, 2).shape == (1, 2, 4, 4)
    with pytest.raises(ValueError, match=r"rank must be below world \(2\), got 2"):
        am.ring_shard(x, 2, 2)
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        am.ring_shard(x, -1, 2)
