"""PyTorch backend: modules are real ``torch.nn.Module`` objects."""
import numpy as np
import torch
import torch.nn.functional as F

from .base import Backend


class TorchModule(torch.nn.Module):
    """Native base: parameters are registered ``nn.Parameter`` objects."""

    def _native_init(self):
        torch.nn.Module.__init__(self)

    def _add_param(self, name, value):
        self.register_parameter(name, torch.nn.Parameter(value))

    def _add_buffer(self, name, value):
        self.register_buffer(name, value, persistent=False)

    def _param(self, name):
        return getattr(self, name)

    def named_arrays(self):
        return dict(self.named_parameters())

    def _assign_param(self, dotted_name, value):
        with torch.no_grad():
            self.get_parameter(dotted_name).copy_(value)

    def to_device(self, device):
        return self.to(self._backend.native_device(device))


def _zero_unused_rows(values, lens, positions):
    """Zero key or value rows past every query's length (NaN there must not
    leak): skipped on the CPU when ``values`` is all finite (a cheap check: the
    sum of a finite array is finite unless it overflows, which only costs the
    zeroing)."""
    if values.device.type == "cpu" and bool(torch.isfinite(values.sum())):
        return values
    longest = lens if lens.dim() == 1 else lens.amax(1)
    used = positions.reshape(1, 1, -1, 1) < longest.reshape(-1, 1, 1, 1)
    return torch.where(used, values, 0.0)


class TorchBackend(Backend):
    name = "torch"
    autodiff = True
    module_base = TorchModule

    def is_array(self, x):
        return isinstance(x, torch.Tensor)

    def asarray(self, x, dtype=None, device=None):
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x))
        return x.to(device=device, dtype=None if dtype is None else getattr(torch, dtype))

    def to_numpy(self, x):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()

    def arange(self, n, device=None):
        return torch.arange(n, dtype=torch.int32, device=device)

    def dtype_name(self, x):
        return str(x.dtype)[len("torch."):]

    def astype(self, x, dtype):
        return x.to(getattr(torch, dtype))

    def matmul(self, a, b, transpose_b=False):
        return torch.matmul(a, b.transpose(-1, -2) if transpose_b else b)

    def linear(self, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def softmax(self, x, axis=-1):
        return torch.softmax(x, dim=axis)

    def where(self, condition, x, y):
        return torch.where(condition, x, y)

    def exp(self, x):
        return torch.exp(x)

    def tanh(self, x):
        return torch.tanh(x)

    def max(self, x, axis, keepdims=False):
        return x.amax(dim=axis, keepdim=keepdims)

    def sum(self, x, axis, keepdims=False):
        return x.sum(dim=axis, keepdim=keepdims)

    def repeat(self, x, repeats, axis):
        return torch.repeat_interleave(x, repeats, dim=axis)

    def transpose(self, x, axes):
        return x.permute(*axes)

    def concatenate(self, xs, axis):
        return torch.cat(list(xs), dim=axis)

    def fused_attention(self, queries, keys, values, lens, scale, memory_budget=None):
        """``F.scaled_dot_product_attention`` on 4-D (batch, heads, n, d) views,
        with a broadcast boolean key mask: its fast (flash) kernel, O(n d)
        extra memory beyond the mask. Declines (None) when the mask would not
        fit in ``memory_budget`` (per-query lengths need a (batch, Q, K) mask)."""
        three_d = queries.dim() == 3
        if three_d:
            queries, keys, values = (x.unsqueeze(1) for x in (queries, keys, values))
        mask = None
        if lens is not None:
            num_q, num_k = queries.shape[-2], keys.shape[-2]
            if (memory_budget is not None and lens.dim() == 2
                    and lens.shape[0] * num_q * num_k > memory_budget):
                return None
            positions = torch.arange(num_k, dtype=torch.int32, device=keys.device)
            mask = (positions < lens.reshape(-1, 1, 1, 1) if lens.dim() == 1 else
                    (positions < lens.unsqueeze(-1)).unsqueeze(1))
            keys = _zero_unused_rows(keys, lens, positions)
            values = _zero_unused_rows(values, lens, positions)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                             scale=scale)
        if lens is not None and not self._sdpa_zeroes_empty_rows(out):
            out = torch.where(mask.any(-1, keepdim=True), out, 0.0)
        return out.squeeze(1) if three_d else out

    def _sdpa_zeroes_empty_rows(self, like):
        """Whether SDPA gives zeros (not NaN or uniform) for a query with no
        valid key on this device and dtype (PyTorch >= 2.5 does); probed once."""
        cache = self.__dict__.setdefault("_empty_rows", {})
        where = (like.device.type, like.dtype)
        if where not in cache:
            x = torch.ones((1, 1, 2, 8), dtype=like.dtype, device=like.device)
            mask = torch.tensor([[False, False], [True, True]], device=like.device)
            with torch.no_grad():   # query 0 has no valid key
                out = F.scaled_dot_product_attention(x, x, x, attn_mask=mask)
            cache[where] = bool((out[0, 0, 0] == 0).all())
        return cache[where]

    def device(self, kind, index=0):
        if kind == "cuda":
            count = torch.cuda.device_count()
            if index >= count:
                raise ValueError(f"device cuda:{index} is not available to the torch "
                                 f"backend ({count} CUDA devices found)")
            return torch.device("cuda", index)
        return super().device(kind, index)

    def _cpu_device(self):
        return torch.device("cpu")

    def device_of(self, x):
        return x.device

    def to_device(self, x, device):
        return x.to(device)

    def uniform(self, shape, low, high, dtype="float32", device=None):
        return torch.empty(shape, dtype=getattr(torch, dtype), device=device).uniform_(low, high)

    def _dropout(self, x, p):
        return F.dropout(x, p, training=True)

    def value_and_grad(self, module, loss_fn):
        params = module.named_arrays()
        for p in params.values():
            p.grad = None
        loss = loss_fn(module)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in params.items()}
