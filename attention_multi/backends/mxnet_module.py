"""Native module base for MXNet: a Gluon ``Block``."""

import mxnet as mx
from mxnet import autograd, gluon, npx

from .devices import native_device

# The init objects of a bare ``initialize()``: Gluon's own default arguments.
_BARE_INITS = (
    gluon.Block.initialize.__defaults__[0],
    gluon.ParameterDict.initialize.__defaults__[0],
)


class _Parameter(gluon.Parameter):
    """A parameter of ours, drawn at construction. A parent block's
    ``initialize(init)`` re-draws it with ``init`` (on its contexts), a bare
    ``initialize()`` keeps it; either silently, where Gluon would warn
    "already initialized, ignoring"."""

    chosen = False  # a parent's initialize(init) chose the draw (kept at a lazy first call)

    def initialize(self, init=None, ctx=None, default_init=_BARE_INITS[1], force_reinit=False):
        bare = init is None and any(default_init is b for b in _BARE_INITS)
        if init is None and not bare:
            self.chosen = True
        if self._data is not None and not force_reinit:
            if bare:
                if ctx is not None:
                    self.reset_ctx(ctx)
                return None
            force_reinit, ctx = True, ctx or self.list_ctx()
        return super().initialize(init, ctx, default_init, force_reinit)


class GluonModule(gluon.Block):
    """Native base: a Gluon ``Block``; ``save_parameters`` gives d2l names.

    Dropout follows Gluon's convention, as ``gluon.nn.Dropout`` does: ``training``
    is ``autograd.is_training()`` (True inside ``autograd.record()``, False
    outside it), until ``train()`` or ``eval()`` pins it for this block and its
    children: ``train()`` keeps dropout on even outside ``record()`` (as
    ``autograd.train_mode()`` would), ``eval()`` keeps it off even inside
    ``record()`` (as ``autograd.predict_mode()`` would). ``train(None)`` goes
    back to following ``autograd``.
    """

    def _native_init(self):
        gluon.Block.__init__(self)
        self._training_mode = None  # None: follow autograd.is_training()

    @property
    def training(self):
        mode = self.__dict__.get("_training_mode")
        return autograd.is_training() if mode is None else mode

    @training.setter
    def training(self, mode):
        if mode is not None and not isinstance(mode, bool):
            raise TypeError(f"training must be True, False or None, got {mode!r}")
        self._training_mode = mode

    def __call__(self, *args, **kwargs):
        # Block.__call__ takes positional arguments only.
        return self.forward(*args, **kwargs) if kwargs else super().__call__(*args)

    def _add_param(self, name, value):
        param = self.params.get(name, shape=value.shape, dtype=value.dtype)
        param.__class__ = _Parameter  # a parent's initialize(init) re-draws it
        if name.endswith("bias"):
            param.init = "zeros"  # as Gluon's Dense: a weight's init is not a bias's
        param.initialize(init=mx.init.Zero(), ctx=value.ctx)  # Uniform fails on float64
        param.set_data(value)
        setattr(self, name, param)

    def _add_lazy_param(self, name, shape):
        # Gluon's deferred initialization: an unknown axis is 0 (-1 under NumPy
        # shape semantics); the data exists once the first call sets the shape
        known = all(n is not None for n in shape)
        param = self.params.get(
            name,
            shape=tuple(n or 0 for n in shape),
            dtype=self._dtype,
            allow_deferred_init=not known,
        )
        param.__class__ = _Parameter
        if name.endswith("bias"):
            param.init = "zeros"
        param.initialize(init=mx.init.Zero(), ctx=self._device)
        setattr(self, name, param)

    def _fill_lazy_param(self, name, value):
        param = getattr(self, name)
        with autograd.pause():  # a first call inside record(), as Gluon's own layers allow
            if param._deferred_init:
                param.shape = tuple(value.shape)
                param._finish_deferred_init()
            if not getattr(param, "chosen", False):  # else Gluon drew it with that init
                param.set_data(value)

    def _unsized(self):
        return [n for n, p in self._collect_params_with_prefix().items() if p._data is None]

    def _add_buffer(self, name, value):
        setattr(self, name, value)

    def _param(self, name):
        return getattr(self, name).data()

    def named_arrays(self):
        return {n: p.data() for n, p in self._collect_params_with_prefix().items()}

    def _assign_param(self, dotted_name, value):
        self._collect_params_with_prefix()[dotted_name].set_data(value)

    def initialize(self, init=None, ctx=None, verbose=False, force_reinit=False):
        """Parameters are initialized at construction (like PyTorch); a bare
        ``initialize()`` as in d2l code keeps them, an ``init`` re-draws them."""
        if init is not None or force_reinit:
            return super().initialize(init or mx.init.Uniform(), ctx, verbose, True)
        if ctx is not None:
            self.collect_params().reset_ctx(ctx)

    def load_parameters(
        self,
        filename,
        ctx=None,
        allow_missing=False,
        ignore_extra=False,
        cast_dtype=False,
        dtype_source="current",
    ):
        unsized = self._unsized()
        if unsized:
            raise ValueError(
                f"{type(self).__name__} has parameters whose sizes are not "
                f"known yet: {', '.join(unsized)} (lazily sized layers); "
                f"call the block once on an example input, then load"
            )
        # Names without a dot (NWKernelRegression's "w") send MXNet 1.9.1 down its
        # legacy loader, which fails in NumPy mode; load them as the normal path does.
        try:
            loaded = npx.load(filename)
        except mx.base.MXNetError:  # e.g. saved without NumPy shape semantics
            loaded = None
        if not isinstance(loaded, dict) or any("." in name for name in loaded):
            return super().load_parameters(
                filename, ctx, allow_missing, ignore_extra, cast_dtype, dtype_source
            )
        params = self._collect_params_with_prefix()
        missing = sorted(set(params) - set(loaded)) if not allow_missing else []
        extra = sorted(set(loaded) - set(params)) if not ignore_extra else []
        if missing or extra:
            raise ValueError(
                f"{filename}: parameters missing {missing}, not in "
                f"this block {extra}; it holds {sorted(params)}"
            )
        for name in set(loaded) & set(params):
            params[name]._load_init(
                loaded[name], ctx, cast_dtype=cast_dtype, dtype_source=dtype_source
            )

    def train(self, mode=True):
        """Pin dropout on (True) or off (False) for this block and its
        children, or follow ``autograd.is_training()`` again (None)."""
        self.training = mode
        for child in self._children.values():
            child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def to_device(self, device):
        self.collect_params().reset_ctx(native_device(self._backend, device))
        return self
