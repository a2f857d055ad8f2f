"""The one table of backends: every list of backend names, and every message
that names them, is derived from ``BACKENDS``. A new backend is one more row."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ALIASES",
    "BACKENDS",
    "BACKEND_NAMES",
    "BackendSpec",
    "ROOTS",
    "framework_of",
    "listing",
]


@dataclass(frozen=True)
class BackendSpec:
    """One row: what the library knows of a backend without importing it."""

    name: str  # canonical name, e.g. "torch"
    module: str  # module of this package that defines the class
    class_name: str  # the ``Backend`` subclass in it
    framework: str  # the framework's import name
    extra: str | None  # pip extra that installs the framework
    aliases: tuple[str, ...] = ()  # other accepted names
    autodiff: bool = True  # ``supports(backend, Autodiff)`` (tests check they agree)
    cuda: bool = True  # whether it can run on CUDA devices
    # the top-level packages whose functions and modules mean this framework
    # (``framework_of``); empty for NumPy, whose functions every framework takes
    roots: tuple[str, ...] | None = None  # None: (framework,)

    @property
    def module_roots(self) -> tuple[str, ...]:
        return (self.framework,) if self.roots is None else self.roots


BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(
        "numpy",
        "numpy",
        "NumpyBackend",
        "numpy",
        None,
        ("np",),
        autodiff=False,
        cuda=False,
        roots=(),
    ),
    BackendSpec("torch", "torch", "TorchBackend", "torch", "torch", ("pytorch",)),
    BackendSpec("jax", "jax", "JaxBackend", "jax", "jax", roots=("jax", "jaxlib")),
    BackendSpec("mxnet", "mxnet", "MXNetBackend", "mxnet", "mxnet", ("mx",)),
    # (its roots are TensorFlow's alone: Keras 3 runs on JAX and torch too, so a
    # function of keras.ops is no framework's until Keras' backend is asked)
    BackendSpec(
        "tensorflow", "tensorflow", "TensorflowBackend", "tensorflow", "tensorflow", ("tf",)
    ),
)

BACKEND_NAMES: tuple[str, ...] = tuple(s.name for s in BACKENDS)
ALIASES: dict[str, str] = {alias: s.name for s in BACKENDS for alias in s.aliases}
# top-level package -> backend name: {"torch": "torch", "jax": "jax", "jaxlib": "jax", ...}
ROOTS: dict[str, str] = {root: s.name for s in BACKENDS for root in s.module_roots}


def framework_of(module: str) -> str | None:
    """The backend whose framework the module named ``module`` belongs to
    (``"jaxlib.xla_extension"`` -> ``"jax"``), else None (NumPy's modules
    too: every framework takes NumPy's functions and arrays)."""
    return ROOTS.get(module.split(".", 1)[0])


def listing(names: Iterable[str], last: str = "or") -> str:
    """``"numpy, torch, jax, mxnet or tensorflow"``: names for a message."""
    names = list(names)
    return "".join(names) if len(names) < 2 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def install_hint(extra: str) -> str:
    """The command that installs a pip extra: from a checkout, since the
    package is on no index (``pip install '.[torch]'``)."""
    return f"pip install '.[{extra}]' (in a checkout of attention-multi)"
