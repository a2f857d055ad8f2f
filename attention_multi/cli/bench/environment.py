"""The machine a bench ran on: CPU, versions, NumPy's BLAS."""

import os
import platform
import sys

import numpy as np

from attention_multi.backends import BACKENDS


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for name in (s.framework for s in BACKENDS):
        if name in sys.modules:
            versions[name] = getattr(sys.modules[name], "__version__", "?")
    from attention_multi.backends.numpy_threads import blas_config

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "versions": versions,
        "numpy_blas": blas_config() or "not OpenBLAS",
    }


def blas_note(info):
    """A hint when NumPy's OpenBLAS runs old kernels on an AVX-512 CPU."""
    config = info["numpy_blas"]
    try:
        with open("/proc/cpuinfo") as f:
            avx512 = " avx512f " in f.read()
    except OSError:
        return ""
    if avx512 and any(
        f" {core} " in f" {config} "
        for core in ("Prescott", "Core2", "Nehalem", "Sandybridge", "Haswell")
    ):
        return (
            "Note: NumPy's OpenBLAS does not recognize this CPU and runs "
            "pre-AVX-512 kernels; OPENBLAS_CORETYPE=SkylakeX in the environment "
            "makes NumPy's matrix products several times faster."
        )
    return ""
