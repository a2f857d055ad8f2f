"""Argument types shared by the commands (``report``, ``bench``): each checks
its text up front and raises ``argparse.ArgumentTypeError`` with the reason, so
that argparse prints ``attention-multi COMMAND: error: argument --NAME: ...``
and exits with status 2 before any work."""

import argparse

from attention_multi import backends


def names(text, check, what):
    """Comma-separated names, each passed through ``check`` (a ValueError is
    the reason), duplicates dropped in order."""
    found = [n.strip() for n in text.split(",") if n.strip()]
    if not found:
        raise argparse.ArgumentTypeError(f"no {what} given in {text!r}")
    try:
        return list(dict.fromkeys(check(n) for n in found))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def backend_names(text):
    """``"pytorch,numpy"`` -> ``["torch", "numpy"]`` (aliases canonicalized)."""
    return names(text, backends.canonical_name, "backends")


def device_names(text):
    def check(name):
        kind, index = backends.parse_device(name)
        return kind if kind == "cpu" else f"{kind}:{index}" if index else kind

    return names(text, check, "devices")


def one_of(choices, what):
    """A type for comma-separated names among ``choices``."""

    def check(name):
        if name not in choices:
            raise ValueError(f"unknown {what} {name!r}; valid choices: {', '.join(choices)}")
        return name

    return lambda text: names(text, check, f"{what}s")


def _number(kind, text, zero_ok, what):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text):
    return _number(int, text, False, "a positive integer")


def nonnegative_int(text):
    return _number(int, text, True, "an integer >= 0")


def positive_float(text):
    return _number(float, text, False, "a positive number of seconds")


def positive_ints(text):
    """``"1,2,4"`` -> ``[1, 2, 4]``."""

    def check(item):
        try:
            return positive_int(item)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None

    return names(text, check, "integers")
