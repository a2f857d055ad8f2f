"""Native module base for PyTorch: a real ``torch.nn.Module``."""
import torch


class TorchModule(torch.nn.Module):
    """Parameters are registered ``nn.Parameter`` objects; ``state_dict``,
    ``.to()``, optimizers and ``load_state_dict`` work as for any module."""

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
