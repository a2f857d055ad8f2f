"""PyTorch backend: modules are real ``torch.nn.Module`` objects."""

import os
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .numpy_like import NumpyLike
from .numpy_threads import openblas
from .protocol import MaskView
from .torch_module import TorchModule

try:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode as _get_proxy_mode
except ImportError:  # pragma: no cover (older torch)
    _get_proxy_mode = None


# host_sum's rows: a contiguous array of at least _ROWS_MIN entries is summed as
# rows of _ROW by one product with ones (made at import)
_ROW, _ROWS_MIN = 4096, 1 << 16
_ONES = {np.dtype(d): np.ones(_ROW, d) for d in (np.float32, np.float64)}

# Filled at import: a dict that grows while torch.compile traces makes its
# guard fail on the next call (one recompile for nothing).
_DTYPE_NAMES: dict = {
    d: str(d)[len("torch.") :]
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def _proxy_mode():
    """Whether ``make_fx`` (the tracer under ``torch.export``) is recording."""
    # (the proxy mode is on the dispatch stack: an empty stack is a cheaper test)
    return (
        _get_proxy_mode is not None
        and torch._C._len_torch_dispatch_stack() > 0
        and _get_proxy_mode() is not None
    )


def _send_recv(x, step, group):
    """Send ``x`` to rank + step and receive from rank - step (in ``group``)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def peer(r):
        r %= size
        return r if group is None else dist.get_global_rank(group, r)

    x = x.contiguous()
    out = torch.empty_like(x)
    requests = [
        dist.isend(x, peer(rank + step), group=group),
        dist.irecv(out, peer(rank - step), group=group),
    ]
    for request in requests:
        request.wait()
    return out


class _RingShift(torch.autograd.Function):
    """``_send_recv`` whose gradient travels the other way round the ring."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _send_recv(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _send_recv(grad, -1, ctx.group), None


class _Waits:
    """How long a parallel region of torch's CPU thread pool waits now, read
    only where ``ATTENTION_MULTI_CALL_COST=measured`` asks (a choice that
    follows the load may change the bits of an answer; by default none
    does): a probe of one region (a fill of 128K floats) at most every
    0.25 s, less its fastest time seen, smoothed. A descheduled pool thread
    makes every region wait for it: sixteen calls wait sixteen times."""

    EVERY = 0.25  # seconds between probes
    SCORES_PER_SECOND = 2e8  # (SDPA on this CPU class, d = 64: what a wait is worth)

    def __init__(self):
        self.buffer = None
        self.when = -1.0
        self.fastest = 5e-5  # seconds: idle, such a fill takes less on any CPU this runs on
        self.wait = None

    def cost(self):
        now = time.monotonic()
        if now - self.when >= self.EVERY:
            self.when = now
            if os.environ.get("ATTENTION_MULTI_CALL_COST") != "measured":
                self.wait = 0.0
            elif torch.get_num_threads() > 1:
                with torch.inference_mode(False), torch.no_grad():  # (a plain tensor, any mode)
                    if self.buffer is None:
                        self.buffer = torch.empty(1 << 17)
                    start = time.perf_counter()
                    self.buffer.fill_(0.0)
                    took = time.perf_counter() - start
                self.fastest = min(self.fastest, took)
                waited = took - self.fastest
                self.wait = waited if self.wait is None else 0.7 * self.wait + 0.3 * waited
        return (self.wait or 0.0) * self.SCORES_PER_SECOND


class _FewerThreads(threading.local):
    """Torch's CPU pool held at half its threads (at least one) in this thread
    while any region is inside (``in_fewer_threads``); the count it had comes
    back when the last leaves."""

    def __init__(self):
        self.depth, self.threads = 0, 1

    def enter(self):
        if self.depth == 0:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(max(1, self.threads // 2))
        self.depth += 1

    def leave(self):
        self.depth -= 1
        if self.depth == 0:
            torch.set_num_threads(self.threads)


_FEWER_THREADS = _FewerThreads()


class _BackwardRegion:
    """Fewer threads from the gradient of a call's output (its hook) to those
    of its inputs (their views' hooks), or the end of the backward pass."""

    def __init__(self, inputs):
        self.inputs, self.left, self.inside = inputs, 0, False

    def enter(self, grad):
        if not self.inside:
            self.inside, self.left = True, self.inputs
            _FEWER_THREADS.enter()
            torch.autograd.Variable._execution_engine.queue_callback(self.leave_now)

    def leave(self, grad):
        self.left -= 1
        if self.left == 0:
            self.leave_now()

    def leave_now(self):
        if self.inside:
            self.inside = False
            _FEWER_THREADS.leave()


class TorchBackend(NumpyLike):
    name = "torch"
    xp = torch
    array_type = torch.Tensor
    module_base = TorchModule
    fused_dropout = True
    fused_causal = True  # (SDPA's is_causal kernels skip blocks above the diagonal)
    kernel_call_cost = 8192
    host_masks = True
    # (64K-256K scores, K <= 256: the full path took 0.47-0.82x of SDPA's path
    # forward, 0.77-0.88x forward and backward, 2-core CPU, d = 16..64)
    small_scores = 1 << 18
    tile_host_cost = 4 * 8192  # (75-140 us a tile, against SDPA's 0.8-2.2 ns a score)
    copy_cost = 0.35  # (gathers and joins: about 1 ns an element against SDPA's 2.8 ns a score)
    weak_scalars = True
    masks_by_adding = True

    # torch spells these differently from NumPy
    max = staticmethod(torch.amax)
    min = staticmethod(torch.amin)
    repeat = staticmethod(torch.repeat_interleave)
    transpose = staticmethod(torch.permute)

    @staticmethod
    def take(x, indices, axis):
        return torch.index_select(x, axis, indices.long())

    def __init__(self):
        super().__init__()
        self._waits = _Waits()

    # Under OpenMP (torch.set_num_threads holds for the calling thread alone).
    # Read when the module loads: a backend may be made inside the first,
    # compiled call (torch.compile(fullgraph=True) traces no parallel_info()).
    fewer_threads = "parallel backend: OpenMP" in torch.__config__.parallel_info()

    def asarray(self, x, dtype=None, device=None):
        if not isinstance(x, torch.Tensor):
            x = np.asarray(x)
            try:
                x = torch.as_tensor(x)
            except TypeError:
                if x.dtype.name != "bfloat16":
                    raise
                # (ml_dtypes' bfloat16, as JAX hands it back, which torch does not read: exact)
                x = torch.as_tensor(x.astype(np.float32)).to(torch.bfloat16)
        return x.to(device=device, dtype=None if dtype is None else getattr(torch, dtype))

    def split(self, x, size, axis):
        return list(torch.split(x, size, axis))

    def matmul(self, a, b, transpose_b=False):
        return torch.matmul(a, b.mT if transpose_b else b)

    def to_numpy(self, x):
        if x.device.type == "cpu" and not x.requires_grad and x.dtype != torch.bfloat16:
            return x.numpy()  # (a view: one call, not three)
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()

    def host_sum(self, x):
        """On the CPU NumPy's sum of a view (no parallel region of torch's
        waits on a busy machine): a contiguous one of at least ``_ROWS_MIN``
        entries as rows of ``_ROW`` summed by one matrix-vector product in
        one BLAS thread, then the rows' sums (2 MB: 45-55 us against NumPy's
        pairwise sum's 115 us here); elsewhere torch's, read back."""
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
            a = x.detach().numpy()
            n = a.size
            if n < _ROWS_MIN or not a.flags.c_contiguous:
                return float(np.sum(a))
            a, rows = a.reshape(-1), n // _ROW
            with openblas().single_threaded():  # (no BLAS thread waits beside torch's)
                head = a[: rows * _ROW].reshape(rows, _ROW) @ _ONES[a.dtype]
            return float(np.sum(head)) + float(np.sum(a[rows * _ROW :]))
        return float(torch.sum(x.detach()))

    def dtype_name(self, x):
        name = _DTYPE_NAMES.get(x.dtype)
        if name is None:
            name = _DTYPE_NAMES[x.dtype] = str(x.dtype)[len("torch.") :]
        return name

    def astype(self, x, dtype):
        return x.to(getattr(torch, dtype))

    def arange(self, n, device=None):
        return torch.arange(n, dtype=torch.int32, device=device)

    def zeros(self, shape, dtype, device=None):
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=device)

    def in_fewer_threads(self, fn, *arrays):
        """The pool at half its threads for ``fn`` (CPU arrays; it returns an array or
        a tuple), and in its backward pass from its outputs' gradients to its
        inputs': each input enters ``fn`` as a view whose gradient's hook leaves."""
        if not self.fewer_threads or any(self.on_accelerator(x.device) for x in arrays):
            return fn(*arrays)
        taped = [torch.is_grad_enabled() and x.requires_grad for x in arrays]
        arrays = tuple(x.view_as(x) if t else x for x, t in zip(arrays, taped))
        _FEWER_THREADS.enter()
        try:
            out = fn(*arrays)
        finally:
            _FEWER_THREADS.leave()
        outs = [y for y in (out if isinstance(out, tuple) else (out,)) if y is not None]
        if any(taped) and any(y.requires_grad for y in outs):
            region = _BackwardRegion(sum(taped))
            for x in (x for x, t in zip(arrays, taped) if t):
                x.register_hook(region.leave)
            for y in (y for y in outs if y.requires_grad):
                y.register_hook(region.enter)
        return out

    def call_cost(self, device=None):
        """On the CPU ``kernel_call_cost`` plus what a parallel region waits
        now (``_Waits``); while tracing, the idle cost (nothing runs)."""
        if self.on_accelerator(device):
            return self.accelerator_call_cost
        if self.is_tracing():
            return self.kernel_call_cost
        return self.kernel_call_cost + self._waits.cost()

    def on_accelerator(self, device):
        return device is not None and device.type not in ("cpu", "meta")

    def is_concrete(self, x):
        """False while torch traces (``is_tracing``) and for tensor
        subclasses (FakeTensor, FunctionalTensor, DTensor), whose values are
        not on the host."""
        if self.is_tracing():
            return False
        return not isinstance(x, torch.Tensor) or type(x) in (torch.Tensor, torch.nn.Parameter)

    def is_tracing(self):
        """``torch.compile``, ``torch.export`` (and so ONNX export),
        ``torch.jit.trace``, ``make_fx``."""
        return torch.compiler.is_compiling() or torch.jit.is_tracing() or _proxy_mode()

    def host_code_traced(self):
        return torch.compiler.is_compiling()

    def may_differentiate(self, x):
        """Under ``torch.jit.trace`` always (one graph for both grad modes:
        its check traces again under ``no_grad``)."""
        return (x.requires_grad and torch.is_grad_enabled()) or torch.jit.is_tracing()

    is_differentiated = may_differentiate

    def snapshot(self, x):
        return x.clone()

    def _copies(self, *arrays):
        """One copy for arrays of one dtype and device (a call each costs a
        parallel region, which waits for descheduled threads on a busy CPU)."""
        if len({(x.dtype, x.device) for x in arrays}) != 1:
            return tuple(x.clone() for x in arrays)
        flat = torch.cat([x.reshape(-1) for x in arrays])
        parts = torch.split(flat, [x.numel() for x in arrays])
        return tuple(p.view(x.shape) for p, x in zip(parts, arrays))

    def keep(self, *arrays):
        """The arrays themselves and their version counters: no copy (a
        parallel region each, waiting on a busy CPU); a read after an in-place
        write raises, as autograd does for what it saved. Tensors made under
        ``inference_mode`` count no writes: copied."""
        if self.is_tracing() or not all(self.is_concrete(x) for x in arrays):
            return self._kept_copies(*arrays)
        try:
            versions = [x._version for x in arrays]
        except RuntimeError:  # (inference tensors)
            return self._kept_copies(*arrays)

        def read():
            if any(x._version != v for x, v in zip(arrays, versions)):
                raise RuntimeError(
                    "attention_weights: the queries or keys of the call that made them "
                    "were modified in place since; read the weights before writing into "
                    "the call's inputs, or pass copies"
                )
            return arrays

        return read

    def _kept_copies(self, *arrays):
        kept = self._copies(*arrays)
        return lambda: kept

    def can_keep(self, x):
        return not x.is_inference()

    def linear(self, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def softmax(self, x, axis=-1):
        return torch.softmax(x, dim=axis)

    def write_slice(self, buffer, update, start, axis):
        index = torch.arange(update.shape[axis], device=buffer.device) + start
        return buffer.index_copy(axis, index, update)  # out of place: autograd sees it

    def checkpoint(self, fn, *args):
        if not torch.is_grad_enabled() or not any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in args
        ):
            return fn(*args)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    def vmap(self, fn):
        return torch.vmap(fn)

    def fused_attention(
        self, queries, keys, values, mask: MaskView, scale, memory_budget=None, dropout=0.0
    ):
        """``F.scaled_dot_product_attention``: no mask, ``is_causal`` when the
        mask is top-left causal, else the mask as booleans (a bias as a float
        mask); grouped-query attention through ``enable_gqa``; its own
        dropout (``dropout_p``). Declines when a
        per-query mask would not fit in ``memory_budget``, and for a bias in
        half precision (SDPA wants the float mask in the inputs' dtype)."""
        options = {"scale": scale, "dropout_p": dropout}
        if queries.shape[1] != keys.shape[1]:
            options["enable_gqa"] = True
        device = queries.device
        if mask.top_left_causal:
            options["is_causal"] = True
        elif not mask.unmasked:
            num_q, num_k = queries.shape[2], keys.shape[2]
            if (
                mask.per_batch_lens is None
                and memory_budget is not None
                and queries.shape[0] * num_q * num_k > memory_budget
            ):
                return None
            if mask.bias is None:
                options["attn_mask"] = mask.boolean(self, device)
            elif queries.dtype in (torch.float32, torch.float64):
                options["attn_mask"] = mask.additive(self, self.dtype_name(queries), device)
            else:
                return None
        return F.scaled_dot_product_attention(queries, keys, values, **options)

    def ring_exchange(self, group):
        """torch.distributed point-to-point (``isend``/``irecv``) in ``group``
        (None: the default group); differentiable (the gradient is passed back
        round the ring)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ring attention on torch needs torch.distributed: call "
                "torch.distributed.init_process_group first"
            )
        return (
            dist.get_rank(group),
            dist.get_world_size(group),
            lambda x: _RingShift.apply(x, group),
        )

    def device(self, kind, index=0):
        if kind == "cpu":
            return torch.device("cpu")
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(
                f"device cuda:{index} is not available to the torch "
                f"backend ({count} CUDA devices found)"
            )
        return torch.device("cuda", index)

    def device_of(self, x):
        return x.device

    def to_device(self, x, device):
        return x if device is None else x.to(device)

    def uniform(self, shape, low, high, dtype="float32", device=None):
        return torch.empty(shape, dtype=getattr(torch, dtype), device=device).uniform_(low, high)

    def seed(self, n):
        torch.manual_seed(n)

    def _dropout(self, x, p):
        return F.dropout(x, p, training=True)

    def gradients(self, loss_fn, module, *inputs):
        params = module.named_arrays()
        for p in params.values():
            p.grad = None
        inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
        loss = loss_fn(module, *inputs)
        loss.backward()
        return (loss.item(), {n: p.grad for n, p in params.items()}, [x.grad for x in inputs])
