"""A busy machine: each framework call waits for the threads the OS has
descheduled. Where the user opts in (``ATTENTION_MULTI_CALL_COST=measured``),
"auto" weighs a kernel call at what it costs now (``Costs.call_cost``,
measured by torch's backend) and takes fewer, larger calls when they wait;
by default it weighs the idle cost, so the load never changes an answer.
The answers stay the oracle's; the calls are counted with torch's own
profiler."""

import time

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle

torch = pytest.importorskip("torch")


def _kernel_calls(f):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = f()
    return out, sum(e.name == "aten::scaled_dot_product_attention" for e in prof.events())


@pytest.fixture
def waits(monkeypatch):
    """Set what a parallel region of torch's pool is measured to wait (seconds)."""
    monkeypatch.setenv("ATTENTION_MULTI_CALL_COST", "measured")
    xp = am.get_backend("torch")

    def set_wait(seconds):
        xp._waits.wait, xp._waits.when = seconds, time.monotonic() + 3600  # (no probe now)

    yield set_wait
    xp._waits.wait, xp._waits.when = None, -1.0


def test_the_measured_cost_of_a_call_is_at_least_the_idle_one(monkeypatch):
    xp = am.get_backend("torch")
    monkeypatch.delenv("ATTENTION_MULTI_CALL_COST", raising=False)
    xp._waits.when, xp._waits.wait = -1.0, 0.01  # (a wait measured before: not read)
    assert xp.call_cost() == xp.kernel_call_cost  # (by default the load is not read)
    monkeypatch.setenv("ATTENTION_MULTI_CALL_COST", "measured")
    xp._waits.when = -1.0
    cost = xp.call_cost()
    assert cost >= xp.kernel_call_cost
    assert xp.call_cost() == cost  # (probed at most every 0.25 s)
    monkeypatch.setenv("ATTENTION_MULTI_CALL_COST", "idle")
    xp._waits.when = -1.0
    assert xp.call_cost() == xp.kernel_call_cost


def test_padding_takes_one_call_when_calls_wait(waits):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((16, 512, 32)).astype(np.float32) for _ in range(3))
    lens = rng.integers(64, 513, 16)
    want, _ = oracle.dot_product_attention(q, k, v, lens)
    m = am.DotProductAttention(0.0, backend="torch").eval()
    args = [torch.tensor(x) for x in (q, k, v, lens)]
    calls = {}
    for name, wait in (("idle", 0.0), ("busy", 0.01)):
        waits(wait)
        out, calls[name] = _kernel_calls(lambda: m(*args))
        assert m.last_path in ("tiled", "fused")
        np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-5)
    assert calls["busy"] == 1 < calls["idle"], calls


def test_packed_rows_are_stacked_when_calls_wait(waits):
    rng = np.random.default_rng(1)
    T, H = 1024, 2
    ids = np.asarray(am.segments_from_lengths([[300, 200, 400, 124]], T))
    q, k, v = (rng.standard_normal((1, H, T, 16)).astype(np.float32) for _ in range(3))
    allowed = (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((T, T), bool))
    want, _ = oracle.attention(q, k, v, mask=allowed[:, None])
    args = [torch.tensor(x) for x in (q, k, v)]
    calls = {}
    for name, wait in (("idle", 0.0), ("busy", 0.01)):
        waits(wait)
        out, calls[name] = _kernel_calls(
            lambda: am.dot_product_attention(*args, segment_ids=torch.tensor(ids), causal=True)
        )
        np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-5)
    assert calls["busy"] < calls["idle"], calls


def test_gathered_tiles_over_blocks_of_queries_and_a_window_equal_the_oracle(waits):
    """Elements of alike lengths between unlike ones are gathered into one
    tile (only the queries and keys it reads), per block of queries, with a
    window that moves the keys' start."""
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(2)
    B, T = 8, 256
    lens = np.array([256, 40, 250, 60, 240, 50, 230, 70])
    q, k, v = (rng.standard_normal((B, T, 16)).astype(np.float32) for _ in range(3))
    want, _ = oracle.attention(*(x[:, None] for x in (q, k, v)), lens, causal=True, window=(96, 0))
    m = am.DotProductAttention(0.0, backend="torch", path="tiled", chunk_size=64).eval()
    args = [torch.tensor(x) for x in (q, k, v, lens)]
    waits(0.002)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = m(*args, causal=True, window=(96, 0))
    assert m.last_path == "tiled"
    assert any(e.name == "aten::index_select" for e in prof.events())  # (gathered)
    np.testing.assert_allclose(out.numpy(), want[:, 0], rtol=2e-5, atol=2e-5)


@pytest.fixture
def accelerator(monkeypatch):
    """torch's CPU arrays taken as on an accelerator (a GPU's choices, here)."""
    xp = am.get_backend("torch")
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, device: True)
    return xp


def test_on_an_accelerator_a_call_is_one_kernel_call_and_no_host_read(accelerator):
    """A GPU computes scores far faster than Python launches kernels, and a
    host read waits for every kernel queued before it: padding and packed
    documents take one kernel call, and no array is read back."""
    from attention_multi.core import numerics

    xp = accelerator
    assert xp.call_cost(torch.device("cpu")) == xp.accelerator_call_cost
    reads = []  # (what the host reads: lengths and ids to plan, no sum of an array)
    to_numpy = xp.to_numpy
    xp.to_numpy = lambda x: reads.append(tuple(x.shape)) or to_numpy(x)
    try:
        rng = np.random.default_rng(2)
        q, k, v = (rng.standard_normal((16, 2, 256, 32)).astype(np.float32) for _ in range(3))
        lens = rng.integers(64, 257, 16)
        ids = np.repeat(np.arange(4), 64)[None].repeat(16, 0)
        allowed = (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((256, 256), bool))
        cases = [
            (dict(valid_lens=torch.tensor(lens)), oracle.attention(q, k, v, lens)[0]),
            (
                dict(segment_ids=torch.tensor(ids), causal=True),
                oracle.attention(q, k, v, mask=allowed[:, None])[0],
            ),
        ]
        args = [torch.tensor(x) for x in (q, k, v)]
        for kw, want in cases:
            out, calls = _kernel_calls(lambda kw=kw: am.dot_product_attention(*args, **kw))
            np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-5)
            assert calls == 1, (list(kw), calls)
        assert numerics.all_finite(xp, args[0]) is False
        assert () not in reads, reads
    finally:
        xp.to_numpy = to_numpy


def test_the_bench_counts_parallel_regions():
    """The bench's call count: one for SDPA over the whole batch, none for
    work below torch's grain or for views, one per compiled region."""
    from attention_multi.cli.bench.timing import torch_calls

    q = torch.randn(8, 2, 128, 32)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert torch_calls(lambda: sdpa(q, q, q)) == 1
    assert torch_calls(lambda: q[:, :1].reshape(8, 128, 32).transpose(1, 2)) == 0
    assert torch_calls(lambda: torch.ones(100) + 1) == 0  # (below the grain)
    assert torch_calls(lambda: [sdpa(q[i : i + 1], q, q) for i in range(0, 8, 2)]) == 4


def test_the_busy_table_pairs_each_row_with_its_idle_twin():
    import os

    from attention_multi.cli.bench.busy import busy_rows, busy_table, one_busy_process

    def speed(key, ratio):
        return (key, "torch", "DotProductAttention", (16, 512, 64), "tiled", "SDPA", ratio, 1.0)

    def packed(what, ratio, err=1e-7):
        return ("torch", what, "flex", ratio, 1.0, ratio, 0.1, err, (3, 1))

    rows = busy_rows(
        [speed("torch-dot-sdpa", 0.9), speed("torch-mha-train", 0.8)],
        [speed("torch-dot-sdpa", 1.1), speed("torch-mha-train", 1.2)],
        [packed("forward", 0.5), packed("block states", 0.01, err=None)],
        [packed("forward", 0.6), packed("block states", 0.02, err=None)],
    )
    assert [(r["busy_ratio"], r["met"]) for r in rows] == [(1.1, False), (1.2, False), (0.6, True)]
    assert rows[0]["busy_over_idle"] == pytest.approx(1.1 / 0.9)  # (met 1.3x; not 1.0x)
    assert "| torch packed forward | flex | - | 0.50x | 0.60x | 1.20x |" in busy_table(rows)
    with one_busy_process():  # (ours only: the other test stack may run its own beside)
        loops = [p for p in os.listdir("/proc") if p.isdigit() and _is_busy_loop(p, os.getpid())]
        assert len(loops) == 1
    assert not [p for p in loops if os.path.exists(f"/proc/{p}") and _is_busy_loop(p)]


def _is_busy_loop(pid, parent=None):
    """Whether process ``pid`` is the bench's busy loop (a child of ``parent``, if given)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"while True: pass" not in f.read():
                return False
        with open(f"/proc/{pid}/stat") as f:  # (pid (name) state ppid ...)
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        return parent is None or ppid == parent
    except (OSError, ValueError, IndexError):
        return False


def _check_backward(out, g, inputs, wants):
    """The backward pass of ``sum(out * g)`` zeroes at most one buffer as large
    as an input per input (the inputs as 4-D: (B, 1, T, d)), and the inputs'
    gradients are the oracle's ``wants``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        (out * torch.tensor(g)).sum().backward()
    B, T, d = inputs[0].shape
    whole = [[B, 1, T, d]]
    fills = sum(e.name == "aten::zero_" and e.input_shapes == whole for e in prof.events())
    assert fills <= 3, fills
    for got, w in zip(inputs, wants):
        np.testing.assert_allclose(got.grad.numpy(), w[:, 0], rtol=1e-4, atol=1e-5)


def test_training_through_tiles_fills_no_input_sized_buffer_per_tile():
    """Tiles of batch elements under autodiff: the inputs are cut into pieces
    whose gradients are joined once, not sliced (a slice's gradient is a
    zeroed buffer as large as the whole input: 20 here, one per tile and
    input, before); gradients the oracle's."""
    rng = np.random.default_rng(3)
    B, T, d = 6, 512, 16
    q, k, v, g = (rng.standard_normal((B, T, d)).astype(np.float32) for _ in range(4))
    lens = np.array([512, 100, 333, 480, 64, 300])
    want = oracle.attention_gradients(*(x[:, None] for x in (q, k, v, g)), lens)[:3]
    args = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    m = am.DotProductAttention(0.0, backend="torch", path="tiled")
    out, tiles = _kernel_calls(lambda: m(*args, torch.tensor(lens)))
    assert m.last_path == "tiled" and tiles >= 4
    _check_backward(out, g, args, want)


@pytest.mark.parametrize(
    "path, forms",
    [
        ("chunked", {"causal": True}),
        ("tiled", {"segment_ids": [[0] * 200 + [1] * 312] * 3, "causal": True}),
        ("tiled", {"score_mod": "half", "causal": True}),
    ],
    ids=["chunked", "segments", "score_mod"],
)
def test_training_through_blocks_fills_no_input_sized_buffer_per_block(path, forms):
    """The chunked and block-sparse paths under autodiff: blocks of queries
    and runs of keys are pieces whose gradients are joined once (a slice's
    gradient is a zeroed buffer as large as the input, per block: 81, 25 and
    23 here before); gradients the oracle's."""
    rng = np.random.default_rng(4)
    B, T, d = 3, 512, 8
    q, k, v, g = (rng.standard_normal((B, T, d)).astype(np.float32) for _ in range(4))
    forms = dict(forms)
    if forms.get("score_mod") == "half":
        forms["score_mod"] = lambda s, b, h, i, j: s * 0.5
        wants = oracle.attention_gradients(
            *(x[:, None] for x in (q, k, v, g)),
            causal=True,
            score_mod=lambda s, b, h, i, j: s * 0.5,
            score_mod_derivative=lambda s, b, h, i, j: np.full_like(s, 0.5),
        )[:3]
    else:
        ids = forms.get("segment_ids")
        kw = {"segment_ids": np.array(ids)} if ids is not None else {}
        wants = oracle.attention_gradients(*(x[:, None] for x in (q, k, v, g)), causal=True, **kw)
        wants = wants[:3]
    if "segment_ids" in forms:
        forms["segment_ids"] = torch.tensor(forms["segment_ids"])
    args = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    m = am.DotProductAttention(0.0, backend="torch", path=path, chunk_size=64)
    out = m(*args, **forms)
    assert m.last_path.family == path  # (tiled: the blocks with segment ids)
    _check_backward(out, g, args, wants)


@pytest.fixture
def pool():
    """torch's pool at two threads at least (one would prove nothing); yields
    what ``in_fewer_threads`` holds it at: half, at least one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield max(1, torch.get_num_threads() // 2)
    torch.set_num_threads(threads)


def test_in_fewer_threads_holds_the_pool_at_half_forward_and_backward(pool):
    """``Threads.in_fewer_threads``: the function's operations and their
    backward pass (from the output's gradient to the inputs') run with half
    the threads of torch's pool; the count comes back after each, also when
    the backward pass stops short of the inputs; values and gradients
    (second order too) are the plain call's."""
    xp = am.get_backend("torch")
    if not xp.fewer_threads:
        pytest.skip("torch's CPU pool is not OpenMP here: set_num_threads is process-wide")
    threads = torch.get_num_threads()
    seen = []

    def f(q, k, v):
        seen.append(("forward", torch.get_num_threads()))
        s = torch.softmax(q @ k.transpose(-1, -2), -1)
        s.register_hook(lambda g: seen.append(("backward", torch.get_num_threads())))
        return s @ v

    x = torch.randn(2, 8, 4, dtype=torch.float64, requires_grad=True)
    out = xp.in_fewer_threads(f, x, x, x)  # (one input three times: one gradient, not three)
    assert torch.get_num_threads() == threads
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    assert torch.get_num_threads() == threads
    assert seen == [("forward", pool), ("backward", pool)]
    (second,) = torch.autograd.grad(grad.sum(), x)
    plain = f(x, x, x)
    (want,) = torch.autograd.grad(plain.sum(), x, create_graph=True)
    (want_second,) = torch.autograd.grad(want.sum(), x)
    assert torch.equal(out, plain) and torch.allclose(grad, want)
    assert torch.allclose(second, want_second)
    inner = xp.in_fewer_threads(f, x, x, x)
    torch.autograd.grad((inner * 2).sum(), inner)  # (stops at the output: no input's hook runs)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("form", ["lengths", "segments"])
def test_on_a_busy_machine_many_calls_run_in_fewer_threads(pool, waits, form):
    """On a busy machine the tiles and the block-sparse path run in half the
    threads of the pool, forward and backward (their many small operations
    wait for fewer descheduled threads): the operations that save tensors for
    the backward pass (torch's saved-tensor hooks) save and unpack them so,
    and a ``score_mod`` runs so without autodiff; answers and gradients the
    oracle's; the count back after."""
    xp = am.get_backend("torch")
    if not xp.fewer_threads:
        pytest.skip("torch's CPU pool is not OpenMP here: set_num_threads is process-wide")
    rng = np.random.default_rng(5)
    B, T, d = 4, 256, 16
    q, k, v, g = (rng.standard_normal((B, T, d)).astype(np.float32) for _ in range(4))
    lens = np.array([256, 40, 200, 90])
    ids = np.repeat(np.arange(4), 64)[None].repeat(B, 0)
    threads, saved, unpacked, modded = torch.get_num_threads(), set(), set(), set()

    def same(s, b, h, i, j):
        modded.add(torch.get_num_threads())
        return s

    if form == "lengths":
        kw, want_kw = {"valid_lens": torch.tensor(lens)}, {"valid_lens": lens}
    else:
        kw = {"segment_ids": torch.tensor(ids), "causal": True, "score_mod": same}
        want_kw = {"segment_ids": ids, "causal": True}
    want = oracle.attention_gradients(*(x[:, None] for x in (q, k, v, g)), **want_kw)[:3]
    out_want, _ = oracle.attention(*(x[:, None] for x in (q, k, v)), **want_kw)
    args = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]

    def pack(x):
        saved.add(torch.get_num_threads())
        return x

    def unpack(x):
        unpacked.add(torch.get_num_threads())
        return x

    waits(0.01)
    m = am.DotProductAttention(0.0, backend="torch", path="tiled")
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = m(*args, **kw)
        assert m.last_path == "tiled" and torch.get_num_threads() == threads
        np.testing.assert_allclose(out.detach().numpy(), out_want[:, 0], rtol=2e-5, atol=2e-5)
        out.sum().backward()  # (the oracle's g comes after: its product saves nothing here)
    assert pool in saved and pool in unpacked, (saved, unpacked)
    assert torch.get_num_threads() == threads
    for x in args:
        x.grad = None
    m(*args, **kw).mul(torch.tensor(g)).sum().backward()
    assert torch.get_num_threads() == threads
    for got, w in zip(args, want):
        np.testing.assert_allclose(got.grad.numpy(), w[:, 0], rtol=1e-4, atol=1e-5)
    modded.clear()
    with torch.no_grad():
        out = m(*args, **kw)
    assert modded == ({pool} if form == "segments" else set()), (modded, m.last_path)
    np.testing.assert_allclose(out.numpy(), out_want[:, 0], rtol=2e-5, atol=2e-5)
