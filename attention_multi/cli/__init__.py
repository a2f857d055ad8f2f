"""The ``attention-multi`` command."""
import argparse
import sys

import backends

from . import port as _port


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
    from . import report
    report.add_arguments(sub.add_parser(
        "report", help="check every mechanism on every backend against a float64 "
                       "reference; write report.md and figures"))
    port = sub.add_parser(
        "port", help="convert an MXNet Gluon .params file to PyTorch or NumPy",
        description="Convert an MXNet Gluon .params file (block.save_parameters) "
                    "to a PyTorch state_dict or a NumPy archive; MXNet is not needed.")
    _port.add_port_arguments(port)
    from . import bench
    bench.add_arguments(sub.add_parser(
        "bench", help="time attention against each framework's own; peak memory"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "bench":
        return bench.run(args)
    if args.command in (None, "info"):
        return _info(args)
    if args.command == "report":
        return report.main(args)
    if args.command == "port":
        return _port.port_command(args)
    return 0
