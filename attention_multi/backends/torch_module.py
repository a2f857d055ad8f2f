"""Native module base for PyTorch: a real ``torch.nn.Module``."""

import torch

from .devices import native_device


class TorchModule(torch.nn.Module):
    """Parameters are registered ``nn.Parameter`` objects; ``state_dict``,
    ``.to()``, optimizers and ``load_state_dict`` work as for any module."""

    def _native_init(self):
        torch.nn.Module.__init__(self)

    def _add_param(self, name, value):
        self.register_parameter(name, torch.nn.Parameter(value))

    def _add_lazy_param(self, name, shape):
        # as nn.LazyLinear: in state_dict and parameters() before its first call
        self.register_parameter(
            name,
            torch.nn.UninitializedParameter(device=self._device, dtype=getattr(torch, self._dtype)),
        )

    def _fill_lazy_param(self, name, value):
        param = getattr(self, name)
        if torch.nn.parameter.is_lazy(param):
            param.materialize(tuple(value.shape))
        with torch.no_grad():
            param.copy_(value)

    # state_dict and load_state_dict as nn.LazyLinear's (LazyModuleMixin): an
    # unsized parameter is saved as it is, and loading a sized one sizes it
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        lazy = torch.nn.parameter.is_lazy
        if not any(lazy(p) for p in self._parameters.values() if p is not None):
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, param in self._parameters.items():
            if param is not None:
                destination[prefix + name] = param if lazy(param) or keep_vars else param.detach()
        for name, buf in self._buffers.items():
            if buf is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = buf if keep_vars else buf.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        lazy = torch.nn.parameter.is_lazy
        for name, param in list(self._parameters.items()):
            given = state_dict.get(prefix + name)
            if param is not None and lazy(param) and given is not None and not lazy(given):
                self._size_lazy_params(name, tuple(given.shape))
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _unsized(self):
        # (isinstance, not torch.nn.parameter.is_lazy: torch.compile traces
        # isinstance without a graph break)
        lazy = torch.nn.parameter.UninitializedTensorMixin
        return [n for n, p in self.named_parameters() if isinstance(p, lazy)]

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
        return self.to(native_device(self._backend, device))
