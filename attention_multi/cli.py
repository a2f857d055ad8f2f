"""The ``attention-multi`` command."""
import argparse
import sys

import backends


def _info(args):
    """Print the installed backends and the devices each can use."""
    from .config import native_device
    for name in backends.BACKEND_NAMES:
        if name not in backends.available_backends():
            print(f"{name:6s}  not installed (pip install 'attention-multi[{name}]')")
            continue
        try:
            B = backends.get_backend(name)
        except ImportError as exc:
            print(f"{name:6s}  unusable: {exc}")
            continue
        devices = ["cpu"]
        try:
            native_device(B, "cuda")
            devices.append("cuda")
        except ValueError:
            pass
        print(f"{name:6s}  devices: {', '.join(devices)}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="attention-multi",
        description="d2l attention mechanisms on NumPy, PyTorch, JAX and MXNet.")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="list installed backends and devices")
    from . import bench
    bench.add_arguments(sub.add_parser(
        "bench", help="time attention against each framework's own; peak memory"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "bench":
        return bench.run(args)
    if args.command in (None, "info"):
        return _info(args)
    return 0
