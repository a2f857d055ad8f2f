"""``attention-multi port``: convert a Gluon ``.params`` file to PyTorch or NumPy."""

import ast
import importlib
import inspect
import os
import sys

import numpy as np

from ..files import atomic_write, check_writable
from ..port import check_params, load_mxnet_params

_EXIT_FAILED, _EXIT_BAD_INPUT = 1, 2
EXIT_CANNOT_WRITE = _EXIT_FAILED


class _CliError(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def add_arguments(parser):
    """Arguments of ``attention-multi port``."""
    parser.add_argument("input", metavar="IN.params", help="an MXNet Gluon .params file")
    parser.add_argument(
        "--to",
        choices=("torch", "numpy"),
        required=True,
        help="torch: torch.save of {name: tensor} (a state_dict); numpy: an .npz archive",
    )
    parser.add_argument(
        "--out",
        metavar="OUT",
        help="output file (default: IN with suffix .pt or .npz); never the input file",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it exists (it is replaced only once the new file is complete)",
    )
    parser.add_argument(
        "--module",
        metavar="NAME",
        help="check names and shapes against this attention_multi module, e.g. MultiHeadAttention",
    )
    parser.add_argument(
        "--args",
        metavar="K=V,...",
        default="",
        help="the module's keyword arguments, comma-separated without spaces, "
        "e.g. key_size=5,query_size=5,value_size=5,num_hiddens=8,num_heads=2,bias=True "
        "(the input sizes too: a module sized at its first call cannot be checked; "
        "dropout, which has no weights, defaults to 0)",
    )
    parser.add_argument(
        "--like",
        metavar="MODULE:FACTORY(ARGS)",
        help="map the file's Gluon names onto the names of the model that "
        "FACTORY (a class or function of the importable MODULE, with "
        "literal ARGS) returns, e.g. 'mypkg.models:build(vocab_size=100)'; "
        "any torch.nn.Module, built and called once if it has lazy "
        "layers. Exit status 1 if the file does not match it",
    )
    parser.add_argument(
        "--show-mapping",
        action="store_true",
        help="with --like: print how the names pair (a table) first",
    )
    parser.add_argument(
        "--dtype",
        choices=("float16", "float32", "float64"),
        help="cast floating-point arrays (default: keep the file's dtype)",
    )
    parser.epilog = (
        "exit status: 0 converted; 1 the file does not match --module, OUT "
        "is the input, OUT exists and --force is not given, or OUT cannot be "
        "written (missing directory, permissions, full disk, not a regular "
        "file: a directory, FIFO or device is never replaced); 2 unreadable "
        "or malformed input, or bad arguments"
    )


def _parse_value(text):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def _parse_args(text):
    kwargs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise _CliError(f"--args: expected KEY=VALUE, got {item!r}", _EXIT_BAD_INPUT)
        kwargs[key.strip()] = _parse_value(value)
    return kwargs


def _module_from_spec(name, args):
    """The module ``name(**args)`` on the NumPy backend (only its shapes matter)."""
    import inspect

    import attention_multi as am

    choices = sorted(
        n
        for n in am.__all__
        if isinstance(getattr(am, n), type)
        and issubclass(getattr(am, n), am.Module)
        and n != "Module"
    )
    if name not in choices:
        raise _CliError(
            f"--module: unknown module {name!r}; choose one of {', '.join(choices)}",
            _EXIT_BAD_INPUT,
        )
    cls, kwargs = getattr(am, name), _parse_args(args)
    if {"backend", "device"} & set(kwargs):
        raise _CliError("--args: backend and device are not module arguments here", _EXIT_BAD_INPUT)
    takes = {*inspect.signature(cls.__init__).parameters, *getattr(cls, "_SEEDS", ())}
    if "dropout" in takes:  # only the shapes matter, and dropout has none
        kwargs.setdefault("dropout", 0.0)
    try:
        return cls(**kwargs, backend="numpy")
    except (TypeError, ValueError) as exc:
        signature = str(inspect.signature(cls.__init__)).replace("self, ", "")
        raise _CliError(
            f"--module {name} --args {args!r}: {exc}; {name}{signature}", _EXIT_BAD_INPUT
        ) from None


def _write_npz(params, f):
    """Like numpy.savez, but any parameter name is fine (even 'file')."""
    import zipfile

    bad = [n for n in params if "\x00" in n]
    if bad:  # zip names end at a NUL: two names would become one
        raise _CliError(f"names with a NUL byte cannot be .npz entries: {bad!r}", _EXIT_BAD_INPUT)
    with zipfile.ZipFile(f, "w", allowZip64=True) as zf:
        for name, value in params.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)


def _import_torch():
    try:
        import torch
    except ImportError as exc:
        raise _CliError(
            f"--to torch needs PyTorch ({exc}); pip install torch", _EXIT_BAD_INPUT
        ) from None
    return torch


def _write_torch(params, f):
    torch = _import_torch()
    torch.save(
        {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in params.items()}, f
    )


def _check_out(out, source, force, given):
    """Refuse to write over the input, over anything but a regular file (a
    directory, FIFO or device, a name ending in a slash: --force or not), or
    over an existing OUT without --force."""
    same = os.path.realpath(out) == os.path.realpath(source)
    if not same and os.path.exists(out):
        try:
            same = os.path.samefile(out, source)
        except OSError:
            pass
    if same:
        named = f"--out {out}" if given else f"the default OUT {out}"
        raise _CliError(
            f"{named} is the input file; choose another name with --out "
            f"(--force does not override this)",
            _EXIT_FAILED,
        )
    check_writable(out)  # WriteError: exit 1, one line
    if os.path.lexists(out) and not force:
        raise _CliError(
            f"{out} exists; add --force to replace it, or choose another --out", _EXIT_FAILED
        )


def _dotted_name(node):
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return head and f"{head}.{node.attr}"
    return None


def _like_from_spec(args):
    """The model that ``--like MODULE:FACTORY(ARGS)`` builds, or None."""
    if args.show_mapping and not args.like:
        raise _CliError("--show-mapping needs --like", _EXIT_BAD_INPUT)
    if not args.like:
        return None
    spec = args.like
    if args.module:
        raise _CliError("--like and --module exclude each other", _EXIT_BAD_INPUT)
    module_name, colon, text = (part.strip() for part in spec.partition(":"))
    try:
        expr = ast.parse(text, mode="eval").body if module_name and colon and text else None
    except SyntaxError:
        expr = None
    call = expr if isinstance(expr, ast.Call) else None
    name = _dotted_name(call.func if call else expr)
    if name is None:
        raise _CliError(
            f"--like {spec!r}: expected MODULE:FACTORY or MODULE:FACTORY(ARGS), "
            f"e.g. 'mypkg.models:build(vocab_size=100)'",
            _EXIT_BAD_INPUT,
        )
    try:
        pos = [ast.literal_eval(a) for a in call.args] if call else []
        kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords} if call else {}
        if None in kw:
            raise ValueError("**kwargs")
    except ValueError:
        raise _CliError(
            f"--like {spec!r}: the arguments must be literals (numbers, strings, lists, ...)",
            _EXIT_BAD_INPUT,
        ) from None
    if os.getcwd() not in sys.path:  # as `python -m` does, for the console script
        sys.path.insert(0, os.getcwd())
    try:
        factory = importlib.import_module(module_name)
        for part in name.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as exc:
        raise _CliError(f"--like {spec!r}: {exc}", _EXIT_BAD_INPUT) from None
    if call is None and not (inspect.isclass(factory) or inspect.isroutine(factory)):
        return factory  # a model object itself
    try:
        return factory(*pos, **kw)
    except Exception as exc:  # the user's code: any error is a bad --like
        raise _CliError(f"--like {spec!r}: {type(exc).__name__}: {exc}", _EXIT_BAD_INPUT) from None


def _mapped_onto(like, params, args):
    """The file's arrays under ``like``'s names; the table with --show-mapping."""
    from ..port import mapping, to_state_dict

    try:
        pairs = mapping(args.input, like=like)
    except (TypeError, ValueError) as exc:  # not a module, or lazy layers never called
        raise _CliError(f"--like {args.like!r}: {exc}", _EXIT_BAD_INPUT) from None
    if args.show_mapping:
        print(pairs)
    try:
        pairs.check()
    except ValueError as exc:
        raise _CliError(str(exc), _EXIT_FAILED) from None
    print(
        f"mapped {len(pairs.rows)} arrays onto {pairs.target_label}"
        + (
            f"; {len(pairs.kept)} kept as the model has them (no Gluon counterpart)"
            if pairs.kept
            else ""
        )
    )
    return to_state_dict(params, like=like)


def _port(args):
    if args.args and not args.module:
        raise _CliError("--args needs --module", _EXIT_BAD_INPUT)
    # OUT and the writer are checked before any work (building --like's model, reading IN)
    out = args.out or os.path.splitext(args.input)[0] + (".pt" if args.to == "torch" else ".npz")
    _check_out(out, args.input, args.force, given=bool(args.out))
    if args.to == "torch":
        _import_torch()
    like = _like_from_spec(args)
    module = _module_from_spec(args.module, args.args) if args.module else None
    try:
        params = load_mxnet_params(args.input)
    except ValueError as exc:
        raise _CliError(str(exc), _EXIT_BAD_INPUT) from None
    except OSError as exc:
        raise _CliError(f"{args.input}: {exc.strerror or exc}", _EXIT_BAD_INPUT) from None
    if module is not None:
        try:
            check_params(params, module, source=args.input)
        except ValueError as exc:
            raise _CliError(str(exc), _EXIT_FAILED) from None
    if like is not None:
        params = _mapped_onto(like, params, args)
    if args.dtype:
        params = {
            n: v.astype(args.dtype) if np.issubdtype(v.dtype, np.floating) else v
            for n, v in params.items()
        }
    with atomic_write(out) as f:
        (_write_torch if args.to == "torch" else _write_npz)(params, f)
    dtypes = sorted({str(v.dtype) for v in params.values()})
    print(
        f"wrote {out}: {len(params)} arrays ({', '.join(dtypes) or 'none'})"
        + (f", checked against {args.module}" if module is not None else "")
    )
    return 0


def main(args):
    """Run ``attention-multi port``; errors go to stderr, and the exit status
    says what went wrong (see ``add_arguments``). OUT is written whole or not
    at all (``attention_multi.files.atomic_write``); ``attention_multi.cli``
    reports a failed write."""
    try:
        return _port(args)
    except _CliError as exc:
        print(f"attention-multi port: error: {exc}", file=sys.stderr)
        return exc.code
