"""The report as text: Markdown tables and sections, and the PNG figures."""

import datetime

import attention_multi as am
from attention_multi import backends

from ...files import atomic_write
from .cases import DTYPES, MECHANISMS, RUNS, TOLERANCES, target
from .run import PLANT, TIMING_SHAPE, Runner, train_nw, versions


def table(header, rows):
    """A Markdown table, padded so that it reads in a terminal too."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return [
        line(header),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        *(line(r) for r in rows),
    ]


def cell_text(cell):
    err, ok, _ = cell
    if err is None:
        return "ERROR"
    return f"{err:.1e} {'ok' if ok else 'FAIL'}"


def summary(cells):
    """(failed, total, sentence) over every cell."""
    total = sum(len(c) for c in cells.values())
    failed = sum(not ok for c in cells.values() for _, ok, _ in c.values())
    if not total:
        return failed, total, "No backend could run: nothing was checked."
    if failed:
        return failed, total, f"FAILED: {failed} of {total} cells."
    return failed, total, f"All {total} cells pass."


def markdown(command, notes, cells, timings, plant):
    """The report's text up to (not including) the figures, as lines."""
    lines = [
        "# attention-multi report",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')}: `{command}`",
        "",
        "## Environment",
        "",
        *(f"- {v}" for v in versions()),
        "",
        "## Backends and devices",
        "",
        *notes,
        "",
    ]
    if plant:
        lines += [
            f"**Planted disagreement (self-test): {PLANT:g} added to every {plant} result.**",
            "",
        ]
    lines += [
        "## Parity with the float64 reference",
        "",
        "Cell: max abs error against `attention_multi.reference` on the same "
        "(rounded) inputs; ok when error <= atol + rtol * max|reference| "
        "(" + "; ".join(f"{d}: atol {a:g}, rtol {r:g}" for d, (a, r) in TOLERANCES.items()) + ").",
        "",
    ]
    labels, errors = list(cells), []
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
    lines += [
        "## Forward time",
        "",
        TIMING_SHAPE,
        "",
        *table(["backend/device", "median"], list(timings.items())),
        "",
        "## Result",
        "",
        summary(cells)[2],
        "",
    ]
    return lines


def multi_head_heatmaps(weights, heads, lens):
    """d2l's heatmaps of (batch * heads, Q, K) weights: a column per head, a
    row per batch element, each row labelled with its element and length."""
    w = weights.reshape((-1, heads) + weights.shape[1:])
    fig = am.show_heatmaps(
        w,
        xlabel="Keys",
        ylabel="Queries",
        titles=[f"Head {h + 1}" for h in range(heads)],
        figsize=(3 * heads + 1, 2.2 * w.shape[0] + 0.6),
    )
    fig.suptitle("Multi-head attention weights")
    for b, first in enumerate(fig.axes[: w.shape[0] * heads : heads]):
        first.set_ylabel(f"batch {b} (valid_len {lens[b]})\nQueries")
    return fig


def figures(out, B, device, inputs, trainer):
    """Write the PNGs into ``out``; returns Markdown lines (or why they were
    skipped). ``trainer`` is (Backend, device) with autodiff, or None."""
    try:
        import matplotlib
    except ImportError as exc:
        return [
            f"Figures skipped: matplotlib is not available ({exc}); "
            f"{backends.install_hint('plot')}."
        ]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = Runner(B, device, "float32")
    i = inputs["float32"]
    lines, figs = [f"Made with the {B.name}/{device} backend, float32."], []

    def save(fig, filename, caption):
        try:
            with atomic_write(out / filename) as f:
                fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
        finally:
            plt.close(fig)
        figs.append(f"![{caption}]({filename})")

    def weights(case):  # the attention weights of a case's module
        return r.numpy(RUNS[case](r, i)[1])

    # The seeds' keys are all ones, so every valid key scores the same: both
    # mechanisms give uniform weights over the valid keys (1/2 and 1/6), alike.
    # The figures say so themselves, not only their captions.
    alike = (
        ": uniform over the valid keys (1/2 and 1/6), as the seeds' keys are all "
        "equal (every valid key scores the same), hence the same picture for both"
    )
    note = (
        "The seeds' keys are all equal, so every valid key scores the same:\n"
        "additive and dot-product attention give the same uniform weights (1/2, 1/6)."
    )
    for case, filename, title in (
        ("AdditiveAttention, seed example", "heatmap_additive.png", "Additive attention"),
        ("DotProductAttention, seed example", "heatmap_dot_product.png", "Dot-product attention"),
    ):
        fig = am.show_heatmaps(
            weights(case).reshape((1, 1, 2, 10)),
            xlabel="Keys",
            ylabel="Queries\n(batch 0, 1)",
            titles=[f"{title}, valid_lens [2, 6]"],
            figsize=(6.4, 2.6),
        )
        fig.supxlabel(note, fontsize=8)
        save(fig, filename, f"{title} weights of the seeds' example{alike}")

    lens = i["m_lens"]
    save(
        multi_head_heatmaps(weights("MultiHeadAttention, bias=False"), 2, lens),
        "heatmap_multihead.png",
        "Multi-head attention weights: one column per "
        "head, one row per batch element (valid_lens " + str(list(lens)) + ")",
    )

    ids = r.lens(i["packed_ids"])

    def packed_causal(b, h, q_idx, kv_idx):  # a mask_mod: own document, causal
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

    net = r.module(am.DotProductAttention, 0.0)
    x = r.a(i["packed_x"])
    net(x, x, x, mask_mod=packed_causal)
    fig = am.show_heatmaps(
        r.numpy(net.attention_weights).reshape((1, 1, 16, 16)),
        xlabel="Keys",
        ylabel="Queries",
        titles=["mask_mod: packed documents of 5, 7 and 4 tokens, causal"],
        figsize=(5.5, 5),
    )
    save(
        fig,
        "heatmap_mask_mod.png",
        "DotProductAttention weights under a mask_mod (three documents packed in one row of "
        "16 tokens, each query causal within its own document): the block-diagonal triangles",
    )

    fig, (ax, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.5), layout="constrained")
    x_test = i["x_test"]
    y_hat = r.numpy(am.nadaraya_watson(r.a(i["x_train"]), r.a(i["y_train"]), r.a(x_test)))
    ax.plot(x_test, target(x_test), label="truth")
    ax.plot(x_test, y_hat, label="Gaussian kernel")
    if trainer is not None:
        (T, trainer_device) = trainer
        w_fit, losses, y_fit = train_nw(T, trainer_device, i)
        ax.plot(x_test, y_fit, "--", label=f"trained on {T.name} (w = {w_fit:.2f})")
        ax_loss.plot(range(1, len(losses) + 1), losses, "o-")
        lines.append(
            f"NWKernelRegression trained on {T.name}/{trainer_device}: "
            f"w = {w_fit:.3f}, loss per epoch " + ", ".join(f"{x:.2f}" for x in losses) + "."
        )
    else:
        trainers = backends.listing(s.name for s in backends.BACKENDS if s.autodiff)
        ax_loss.text(0.5, 0.5, f"no autodiff backend\n({trainers})", ha="center", va="center")
        lines.append(
            "NWKernelRegression not trained: no autodiff backend ran "
            f"({backends.install_hint('torch')})."
        )
    ax.plot(i["x_train"], i["y_train"], "o", alpha=0.5, label="training points")
    ax.set(xlabel="x", ylabel="y", xlim=(0, 5), title="Nadaraya-Watson regression")
    ax.legend()
    ax_loss.set(xlabel="epoch", ylabel="loss", title="Training loss (summed squares)")
    save(fig, "nadaraya_watson.png", "Nadaraya-Watson fit and training loss")
    return lines + [""] + figs
