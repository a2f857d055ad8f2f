"""``attention-multi report``: every mechanism on every backend and device,
checked against the independent float64 reference (``reference.py``).

Prints, and writes to ``DIR/report.md``: the environment, one table per dtype
(rows: mechanisms; columns: backend/device; cells: max abs error and ok/FAIL),
and the forward time of each backend. With the ``plot`` extra it also writes
PNG heatmaps and the Nadaraya-Watson fit. Exit code: 0 when every cell passes,
1 when any cell fails, 2 when no backend could run.

Self-test: ``--plant BACKEND`` adds 1e-2 to that backend's results before they
are compared, so its cells must FAIL and the exit code must be 1 (report.md
says that the run was planted). The tests use it to prove that a disagreement
is caught.
"""
import argparse
import datetime
import importlib.metadata
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import backends

from . import reference as ref

DTYPES = ("float32", "float64")
TOLERANCES = {"float32": (2e-5, 1e-5), "float64": (1e-10, 1e-10)}  # (atol, rtol)
PLANT = 1e-2
AUTODIFF = ("torch", "jax", "mxnet")   # backends that can train NWKernelRegression
DEFAULT_OUT = "attention-multi-report"


# -- fixed inputs --------------------------------------------------------------

def f(x):
    """Seed 003's target function."""
    return 2 * np.sin(x) + x ** 0.8


def make_inputs(seed=0):
    """All inputs and weights, float64 NumPy (lengths are int64)."""
    rng = np.random.default_rng(seed)
    normal, uniform = rng.standard_normal, rng.uniform

    def linear_params(prefix, out, inp, bias):
        bound = 1 / np.sqrt(inp)
        p = {f"{prefix}.weight": uniform(-bound, bound, (out, inp))}
        if bias:
            p[f"{prefix}.bias"] = uniform(-bound, bound, (out,))
        return p

    def mha_params(bias):
        p = {}
        for name, size in (("W_q", 5), ("W_k", 3), ("W_v", 7), ("W_o", 8)):
            p.update(linear_params(name, 8, size, bias))
        return p

    x_train = np.sort(rng.random(50) * 5)
    y_train = f(x_train) + rng.normal(0.0, 0.5, 50)
    others = ~np.eye(50, dtype=bool)
    return {
        "X": normal((2, 2, 4)), "lens1": np.array([2, 3]),
        "X2": normal((2, 3, 5)), "lens2": np.array([[1, 3, 5], [2, 4, 0]]),
        "S": normal((3, 5)), "S_lens": np.array([0, 2, 5]),
        # seed 000: keys of ones, values arange(40), valid_lens [2, 6]
        "seed_keys": np.ones((2, 10, 2)),
        "seed_values": np.tile(np.arange(40.0).reshape(1, 10, 4), (2, 1, 1)),
        "seed_lens": np.array([2, 6]),
        "dot_q": normal((2, 1, 2)),
        "add_q": normal((2, 1, 20)),
        "add_params": {**linear_params("W_q", 8, 20, False),
                       **linear_params("W_k", 8, 2, False),
                       **linear_params("w_v", 1, 8, False)},
        "q": normal((2, 3, 4)), "k": normal((2, 5, 4)), "v": normal((2, 5, 3)),
        "mq": normal((2, 4, 5)), "mk": normal((2, 6, 3)), "mv": normal((2, 6, 7)),
        "m_lens": np.array([3, 5]),
        "mha": mha_params(False), "mha_bias": mha_params(True),
        "P_X": normal((2, 7, 6)),
        "x_train": x_train, "y_train": y_train, "x_test": np.arange(0, 5, 0.1),
        "nw_w": np.array([1.7]),
        "nw_keys": np.tile(x_train, (50, 1))[others].reshape(50, -1),
        "nw_values": np.tile(y_train, (50, 1))[others].reshape(50, -1),
    }


def rounded(inputs, dtype):
    """Floats rounded to ``dtype`` (kept float64), so the reference sees
    exactly what the backend sees."""
    if isinstance(inputs, dict):
        return {k: rounded(v, dtype) for k, v in inputs.items()}
    if inputs.dtype.kind == "f":
        return inputs.astype(dtype).astype(np.float64)
    return inputs


# -- the mechanisms, on a backend and by the reference ------------------------------

class Runner:
    """Builds arrays and modules for one backend, device and dtype."""

    def __init__(self, am, backend, device, dtype):
        self.am, self.backend, self.device, self.dtype = am, backend, device, dtype

    def a(self, x):
        return self.am.asarray(x, self.dtype, backend=self.backend, device=self.device)

    def lens(self, x):
        return self.am.asarray(x, "int32", backend=self.backend, device=self.device)

    def module(self, cls, *args, params=None, **kwargs):
        net = cls(*args, backend=self.backend, device=self.device, dtype=self.dtype,
                  **kwargs)
        if params is not None:
            self.am.set_params(net, params)
        return net.eval()


def _attention(r, net, q, k, v, lens):
    return [net(r.a(q), r.a(k), r.a(v), r.lens(lens)), net.attention_weights]


def _mha(r, i, params):
    net = r.module(r.am.MultiHeadAttention, 3, 5, 7, 8, 2, 0.5,
                   bias="W_q.bias" in params, params=params)
    return _attention(r, net, i["mq"], i["mk"], i["mv"], i["m_lens"])


# (row name, run on a backend -> arrays, reference -> float64 arrays)
CASES = [
    ("masked_softmax, valid_lens (B,)",
     lambda r, i: [r.am.masked_softmax(r.a(i["X"]), r.lens(i["lens1"]))],
     lambda i: [ref.masked_softmax(i["X"], i["lens1"])]),
    ("masked_softmax, valid_lens (B, Q)",
     lambda r, i: [r.am.masked_softmax(r.a(i["X2"]), r.lens(i["lens2"]))],
     lambda i: [ref.masked_softmax(i["X2"], i["lens2"])]),
    ("sequence_mask",
     lambda r, i: [r.am.sequence_mask(r.a(i["S"]), r.lens(i["S_lens"]), value=-1.0)],
     lambda i: [ref.sequence_mask(i["S"], i["S_lens"], -1.0)]),
    ("DotProductAttention, seed example",
     lambda r, i: _attention(r, r.module(r.am.DotProductAttention, 0.5), i["dot_q"],
                             i["seed_keys"], i["seed_values"], i["seed_lens"]),
     lambda i: list(ref.dot_product_attention(i["dot_q"], i["seed_keys"],
                                              i["seed_values"], i["seed_lens"]))),
    ("DotProductAttention, valid_lens (B, Q)",
     lambda r, i: _attention(r, r.module(r.am.DotProductAttention, 0.5),
                             i["q"], i["k"], i["v"], i["lens2"]),
     lambda i: list(ref.dot_product_attention(i["q"], i["k"], i["v"], i["lens2"]))),
    ("AdditiveAttention, seed example",
     lambda r, i: _attention(r, r.module(r.am.AdditiveAttention, 2, 20, 8, 0.1,
                                         params=i["add_params"]),
                             i["add_q"], i["seed_keys"], i["seed_values"], i["seed_lens"]),
     lambda i: list(ref.additive_attention(i["add_params"], i["add_q"], i["seed_keys"],
                                           i["seed_values"], i["seed_lens"]))),
    ("MultiHeadAttention, bias=False",
     lambda r, i: _mha(r, i, i["mha"]),
     lambda i: list(ref.multi_head_attention(i["mha"], i["mq"], i["mk"], i["mv"],
                                             i["m_lens"], 2))),
    ("MultiHeadAttention, bias=True",
     lambda r, i: _mha(r, i, i["mha_bias"]),
     lambda i: list(ref.multi_head_attention(i["mha_bias"], i["mq"], i["mk"], i["mv"],
                                             i["m_lens"], 2))),
    ("PositionalEncoding",
     lambda r, i: [r.module(r.am.PositionalEncoding, 6, 0.0, max_len=50)(r.a(i["P_X"]))],
     lambda i: [ref.positional_encoding(i["P_X"])]),
    ("nadaraya_watson",
     lambda r, i: list(r.am.nadaraya_watson(r.a(i["x_train"]), r.a(i["y_train"]),
                                            r.a(i["x_test"]), return_weights=True)),
     lambda i: list(ref.nadaraya_watson(i["x_train"], i["y_train"], i["x_test"]))),
    ("NWKernelRegression forward",
     lambda r, i: [r.module(r.am.NWKernelRegression, params={"w": i["nw_w"]})(
         r.a(i["x_train"]), r.a(i["nw_keys"]), r.a(i["nw_values"]))],
     lambda i: [ref.nw_kernel_regression(i["nw_w"][0], i["x_train"], i["nw_keys"],
                                         i["nw_values"])]),
]
MECHANISMS = [name for name, _, _ in CASES]


def compare(got, want, dtype):
    """(max abs error, passed) of backend results against the reference."""
    atol, rtol = TOLERANCES[dtype]
    if [g.shape for g in got] != [w.shape for w in want]:
        raise ValueError(f"shapes {[g.shape for g in got]} differ from the "
                         f"reference's {[w.shape for w in want]}")
    err = max(float(np.max(np.abs(g.astype(np.float64) - w), initial=0.0))
              for g, w in zip(got, want))
    scale = max(float(np.max(np.abs(w), initial=0.0)) for w in want)
    return err, bool(err <= atol + rtol * scale)   # NaN fails


def run_pair(am, backend, device, inputs, refs, plant):
    """{(mechanism, dtype): (error or None, passed, message)} for one backend/device."""
    B = backends.get_backend(backend)
    cells = {}
    for dtype in DTYPES:
        if dtype not in B.float_dtypes:
            continue
        r = Runner(am, backend, device, dtype)
        for name, run, _ in CASES:
            try:
                got = [B.to_numpy(x) for x in run(r, inputs[dtype])]
                if plant:
                    got = [g + PLANT for g in got]
                err, ok = compare(got, refs[dtype][name], dtype)
                cells[name, dtype] = (err, ok, "")
            except Exception as exc:    # one broken mechanism must not stop the report
                cells[name, dtype] = (None, False, f"{type(exc).__name__}: {exc}")
    return cells


def time_forward(am, backend, device, repeats=5):
    """Median seconds of a float32 MultiHeadAttention forward (+ copy to NumPy)."""
    rng = np.random.default_rng(1)
    r = Runner(am, backend, device, "float32")
    net = r.module(am.MultiHeadAttention, 128, 128, 128, 128, 8, 0.0)
    q, kv = r.a(rng.standard_normal((8, 64, 128))), r.a(rng.standard_normal((8, 64, 128)))
    lens = r.lens(rng.integers(1, 65, 8))
    B = backends.get_backend(backend)
    times = []
    for _ in range(repeats + 1):           # the first run warms up
        start = time.perf_counter()
        B.to_numpy(net(q, kv, kv, lens))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


TIMING_SHAPE = ("MultiHeadAttention forward, float32: batch 8, 64 queries x 64 keys, "
                "128 hiddens, 8 heads, valid_lens (8,); median of 5 after a warm-up, "
                "copy to NumPy included")


# -- backends, devices, environment --------------------------------------------

def backend_state(name):
    """(usable, note): 'not installed' with the pip extra, or why import fails."""
    if name not in backends.available_backends():
        return False, f"not installed (pip install 'attention-multi[{name}]')"
    try:
        backends.get_backend(name)
    except ImportError as exc:
        cause = exc.__cause__ or exc
        reason = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else ""
        return False, f"installed but fails to import ({type(cause).__name__}: {reason})"
    return True, ""


def device_state(name, device):
    """(native device or None, note)."""
    from .config import native_device
    try:
        return native_device(backends.get_backend(name), device), ""
    except ValueError as exc:
        return None, f"{device} not available ({exc})"


def versions():
    out = [f"Python {sys.version.split()[0]} ({platform.platform()})"]
    for dist in ("numpy", "torch", "jax", "jaxlib", "mxnet", "matplotlib"):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return out


def enable_float64(name):
    """JAX computes float64 only with x64 on (explicit float32 stays float32)."""
    if name == "jax":
        import jax
        jax.config.update("jax_enable_x64", True)


# -- output -----------------------------------------------------------------------

def cell_text(cell):
    err, ok, message = cell
    if err is None:
        return "ERROR"
    return f"{err:.1e} {'ok' if ok else 'FAIL'}"


def table(header, rows):
    """A Markdown table, padded so that it reads in a terminal too."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
            *(line(r) for r in rows)]


def figures(am, out, backend, device, inputs, trainer):
    """Write the PNGs; returns Markdown lines (or why they were skipped)."""
    try:
        import matplotlib
    except ImportError as exc:
        return [f"Figures skipped: matplotlib is not available ({exc}); "
                "pip install 'attention-multi[plot]'."]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = Runner(am, backend, device, "float32")
    i = inputs["float32"]
    lines, figs = [f"Made with the {backend}/{device} backend, float32."], []

    def save(fig, filename, caption):
        fig.savefig(out / filename, dpi=100, bbox_inches="tight")
        plt.close(fig)
        figs.append(f"![{caption}]({filename})")

    runs = {name: run for name, run, _ in CASES}

    def weights(case):       # the attention weights of a case's module
        return _np(r, runs[case](r, i)[1])

    for case, filename, caption in (
            ("AdditiveAttention, seed example", "heatmap_additive.png",
             "Additive attention weights, valid_lens [2, 6]"),
            ("DotProductAttention, seed example", "heatmap_dot_product.png",
             "Dot-product attention weights, valid_lens [2, 6]")):
        save(am.show_heatmaps(weights(case).reshape((1, 1, 2, 10)), xlabel="Keys",
                              ylabel="Queries"), filename, caption)

    w = weights("MultiHeadAttention, bias=False")      # (batch * heads, Q, K)
    heads = 2
    w = w.reshape((-1, heads) + w.shape[1:])
    save(am.show_heatmaps(w, xlabel="Keys", ylabel="Queries",
                          titles=[f"Head {h + 1}" for h in range(heads)],
                          figsize=(2.5 * heads, 1.9 * w.shape[0])),
         "heatmap_multihead.png", "Multi-head attention weights, one panel per head "
         "(rows: batch, valid_lens [3, 5])")

    fig, (ax, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.5))
    x_test = i["x_test"]
    y_hat = _np(r, am.nadaraya_watson(r.a(i["x_train"]), r.a(i["y_train"]),
                                      r.a(x_test)))
    ax.plot(x_test, f(x_test), label="truth")
    ax.plot(x_test, y_hat, label="Gaussian kernel")
    if trainer is not None:
        w_fit, losses, y_fit = train_nw(am, trainer, i)
        ax.plot(x_test, y_fit, "--", label=f"trained on {trainer[0]} (w = {w_fit:.2f})")
        ax_loss.plot(range(1, len(losses) + 1), losses, "o-")
        lines.append(f"NWKernelRegression trained on {trainer[0]}/{trainer[1]}: "
                        f"w = {w_fit:.3f}, loss per epoch "
                        + ", ".join(f"{x:.2f}" for x in losses) + ".")
    else:
        ax_loss.text(0.5, 0.5, "no autodiff backend\n(torch, jax or mxnet)",
                     ha="center", va="center")
        lines.append("NWKernelRegression not trained: no autodiff backend ran "
                        "(pip install 'attention-multi[torch]').")
    ax.plot(i["x_train"], i["y_train"], "o", alpha=0.5, label="training points")
    ax.set(xlabel="x", ylabel="y", xlim=(0, 5), title="Nadaraya-Watson regression")
    ax.legend()
    ax_loss.set(xlabel="epoch", ylabel="loss", title="Training loss (summed squares)")
    save(fig, "nadaraya_watson.png", "Nadaraya-Watson fit and training loss")
    return lines + [""] + figs


def _np(r, x):
    return backends.get_backend(r.backend).to_numpy(x)


def train_nw(am, trainer, i, epochs=5, lr=0.5):
    """Seed 003's training on ``trainer`` = (backend, device); returns
    (w, losses, predictions on x_test)."""
    r = Runner(am, *trainer, "float32")
    net = r.module(am.NWKernelRegression, params={"w": np.array([0.3])})
    losses = am.train_kernel_regression(net, r.a(i["x_train"]), r.a(i["y_train"]),
                                        epochs=epochs, lr=lr)
    x_test, n = i["x_test"], len(i["x_train"])
    keys = np.tile(i["x_train"], (len(x_test), 1))
    values = np.tile(i["y_train"], (len(x_test), 1))
    y_fit = _np(r, net(r.a(x_test), r.a(keys), r.a(values)))
    return float(am.get_params(net)["w"][0]), [float(x) for x in losses], y_fit


# -- the command ---------------------------------------------------------------------

def _names(text, check, what):
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no {what} given in {text!r}")
    try:
        return list(dict.fromkeys(check(n) for n in names))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _backend_names(text):
    return _names(text, backends.canonical_name, "backends")


def _device_names(text):
    from .config import parse_device

    def check(name):
        kind, index = parse_device(name)
        return kind if kind == "cpu" else f"{kind}:{index}" if index else kind
    return _names(text, check, "devices")


def add_arguments(parser):
    parser.add_argument("--backends", type=_backend_names,
                        default=list(backends.BACKEND_NAMES),
                        help="comma-separated, default: all (%(default)s)")
    parser.add_argument("--devices", type=_device_names, default=["cpu", "cuda"],
                        help="comma-separated, default: cpu,cuda (absent ones are "
                             "listed, not failed)")
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT),
                        help="directory for report.md and the PNGs (default: "
                             "./%(default)s)")
    parser.add_argument("--plant", metavar="BACKEND", type=backends.canonical_name,
                        help="self-test: add 1e-2 to BACKEND's results, so that its "
                             "cells must FAIL")
    return parser


def main(args):
    import attention_multi as am
    if args.plant and args.plant not in args.backends:
        print(f"attention-multi report: --plant {args.plant} is not among --backends "
              f"{','.join(args.backends)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    inputs = {d: rounded(make_inputs(), d) for d in DTYPES}
    refs = {d: {name: reference(inputs[d]) for name, _, reference in CASES}
            for d in DTYPES}

    notes, pairs = [], []
    for name in args.backends:
        usable, note = backend_state(name)
        if not usable:
            notes.append(f"- {name}: {note}")
            continue
        found = []
        for device in args.devices:
            native, note = device_state(name, device)
            found.append(note or f"{device} ({native})")
            if native is not None:
                pairs.append((name, device))
        notes.append(f"- {name}: " + "; ".join(found))

    cells, timings = {}, {}
    for name, device in pairs:
        label = f"{name}/{device}"
        print(f"report: running {label} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        enable_float64(name)
        cells[label] = run_pair(am, name, device, inputs, refs, name == args.plant)
        try:
            timings[label] = f"{time_forward(am, name, device) * 1e3:.2f} ms"
        except Exception as exc:
            timings[label] = f"ERROR {type(exc).__name__}: {exc}"
        failed = sum(not ok for _, ok, _ in cells[label].values())
        print(f"report: {label}: {len(cells[label])} cells, {failed} failed, "
              f"{time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)

    lines = ["# attention-multi report", "",
             f"{datetime.datetime.now().isoformat(timespec='seconds')}: "
             f"`attention-multi report --backends {','.join(args.backends)} "
             f"--devices {','.join(args.devices)}`", "", "## Environment", ""]
    lines += [f"- {v}" for v in versions()]
    lines += ["", "## Backends and devices", "", *notes, ""]
    if args.plant:
        lines += [f"**Planted disagreement (self-test): {PLANT:g} added to every "
                  f"{args.plant} result.**", ""]

    lines += ["## Parity with the float64 reference", "",
              "Cell: max abs error against `attention_multi.reference` on the same "
              "(rounded) inputs; ok when error <= atol + rtol * max|reference| "
              "(" + "; ".join(f"{d}: atol {a:g}, rtol {r:g}"
                              for d, (a, r) in TOLERANCES.items()) + ").", ""]
    labels = list(cells)
    errors = []
    for dtype in DTYPES:
        rows = []
        for mech in MECHANISMS:
            row = [mech]
            for label in labels:
                cell = cells[label].get((mech, dtype))
                row.append("n/a" if cell is None else cell_text(cell))
                if cell is not None and cell[2]:
                    errors.append(f"- {label} {dtype} {mech}: {cell[2]}")
            rows.append(row)
        lines += [f"### {dtype}", "", *table(["mechanism", *labels], rows), ""]
    if errors:
        lines += ["Errors:", "", *errors, ""]

    total = sum(len(c) for c in cells.values())
    failed = sum(not ok for c in cells.values() for _, ok, _ in c.values())
    lines += ["## Forward time", "", TIMING_SHAPE, "",
              *table(["backend/device", "median"], list(timings.items())), ""]
    if not total:
        summary = "No backend could run: nothing was checked."
    elif failed:
        summary = f"FAILED: {failed} of {total} cells."
    else:
        summary = f"All {total} cells pass."
    lines += ["## Result", "", summary, ""]
    print("\n".join(lines))

    lines += ["## Figures", ""]
    if pairs:
        trainer = next((p for p in pairs if p[0] in AUTODIFF), None)
        try:
            lines += figures(am, out, *pairs[0], inputs, trainer)
        except Exception as exc:   # figures are extras; parity decides the exit code
            lines += [f"Figures failed: {type(exc).__name__}: {exc}"]
        print(lines[-1] if lines[-1].startswith("Figures") else
              f"Figures: {', '.join(sorted(p.name for p in out.glob('*.png')))}")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"Wrote {out / 'report.md'}")
    return 1 if failed else 2 if not total else 0
