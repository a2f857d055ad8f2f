"""Native module base for PyTorch: a real ``torch.nn.Module``."""
import torch


class TorchModule(torch.nn.Module):
    """Parameters are registered ``nn.Parameter`` objects; ``state_dict``,
    ``.to()``, optimizers and ``load_state_dict`` work as for any module."""

    def _native_init(self):
        torch.nn.Module.__init__(self)

    def _add_param(self, name, value):
        self.register_parameter(name, torch.nn.Parameter(value))

    def _add_lazy_param(self, name, shape):
        # as nn.LazyLinear: in state_dict and parameters() before its first call
        self.register_parameter(name, torch.nn.UninitializedParameter(
            device=self._device, dtype=getattr(torch, self._dtype)))

    def _fill_lazy_param(self, name, value):
        param = getattr(self, name)
        if torch.nn.parameter.is_lazy(param):
            param.materialize(tuple(value.shape))
        with torch.no_grad():
            param.copy_(value)

    def _unsized(self):
        return [n for n, p in self.named_parameters() if torch.nn.parameter.is_lazy(p)]

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
