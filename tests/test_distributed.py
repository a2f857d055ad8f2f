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
    kwargs = {k: v for k, v in D.RING_CASES[name][0].items() if k != "memory_budget"}
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = am.dot_product_attention(q, k, v, None if lens is None else torch.tensor(lens), **kwargs)
    (out * torch.tensor(g)).sum().backward()
    return {
        key: x.detach().numpy()
        for key, x in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))
    }


def ring_oracle(name, size):
    """The float64 oracle's output on the whole sequence, its mask spelled out
    from the rules of README's masking contract."""
    from attention_multi.reference import softmax_where

    q, k, v, _, lens = D.ring_inputs(name, size)
    kwargs = D.RING_CASES[name][0]
    num_q, num_k = q.shape[2], k.shape[2]
    p = np.arange(num_q)[:, None] + (num_k - num_q)
    j = np.arange(num_k)[None, :]
    visible = np.ones((q.shape[0], 1, num_q, num_k), bool)
    if lens is not None:
        visible &= j < (lens[:, None, None, None] if lens.ndim == 1 else lens[:, None, :, None])
    if kwargs.get("causal"):
        visible &= j <= p
    if "window" in kwargs:
        left, right = kwargs["window"]
        visible &= (j >= p - left) & (j <= p + right)
    weights = softmax_where(np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1]), visible)
    return np.einsum("bhqk,bhkd->bhqd", weights, v)


def _gather(parts, key, name):
    """Concatenate the shards of all ranks along the sequence axis."""
    return np.concatenate([p[f"{name}.{key}"] for p in parts], axis=2)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(D.RING_CASES))
def test_torch_ring_attention_equals_one_process(torch_runs, name, size):
    parts = torch_runs[size]["ring"]
    expected = ring_expected(name, size)
    assert_close(_gather(parts, "out", name), ring_oracle(name, size), **TOL)
    for key in ("out", "dq", "dk", "dv"):
        assert_close(_gather(parts, key, name), expected[key], **TOL)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(D.RING_CASES))
def test_jax_ring_attention_equals_one_device(jax_runs, name, size):
    got = jax_runs[size]["ring"]
    expected = ring_expected(name, size)
    assert_close(got[f"{name}.out"], ring_oracle(name, size), **TOL)
    for key in ("out", "dq", "dk", "dv"):
        assert_close(got[f"{name}.{key}"], expected[key], **TOL)


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
