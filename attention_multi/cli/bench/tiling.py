"""What padding-aware tiles can reach on this machine, in plain torch: SDPA
calls over groups of batch elements sorted by length, each group over the
keys its longest element sees, against one SDPA call with the padding mask
(the peer of the large-batch rows). No code of ours runs: the table bounds
what any tiling of the framework's kernel can win at these lengths.

- ``sorted``: the elements already in length order (each group a slice, no
  copies): the least a tiling can take, and more than a real batch allows;
- ``gathered``: the batch in its own order, as a user's is (each group's
  rows copied out, the outputs put back in order)."""

import numpy as np

from .timing import compare, random_lens, rng_inputs

GROUPS = (2, 4)


def tiling_rows(shape, seconds):
    """One dict per plan: its groups, the share of the one call's scores it
    computes, its time and the one call's (medians of interleaved bursts),
    and its largest difference from the one call's output."""
    import torch
    import torch.nn.functional as F

    B, T, d = shape
    q, k, v = (torch.from_numpy(x)[:, None] for x in rng_inputs(shape))
    lens = torch.from_numpy(random_lens(B, T))
    order = torch.argsort(lens, stable=True)
    back = torch.argsort(order)
    sorted_qkv = [x.index_select(0, order) for x in (q, k, v)]
    sorted_lens = lens[order]

    def one_call():
        mask = (torch.arange(T) < lens[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def masked(x, y, z, group_lens):  # (y, z: the keys and values up to the longest)
        mask = (torch.arange(y.shape[2]) < group_lens[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(x, y, z, attn_mask=mask)

    def sorted_plan(n):
        qs, ks, vs = sorted_qkv
        outs = []
        for a, b in _cuts(B, n):
            longest = int(sorted_lens[a:b].max())
            outs.append(
                masked(qs[a:b], ks[a:b, :, :longest], vs[a:b, :, :longest], sorted_lens[a:b])
            )
        return outs

    def gathered_plan(n):  # (the keys cut to the group's longest, then its rows copied)
        outs = []
        for rows in (order[a:b] for a, b in _cuts(B, n)):
            longest = int(lens[rows].max())
            y, z = (x[:, :, :longest].index_select(0, rows) for x in (k, v))
            outs.append(masked(q.index_select(0, rows), y, z, lens[rows]))
        return torch.cat(outs).index_select(0, back)

    rows = []
    with torch.no_grad():
        expected = one_call()
        for n in GROUPS:
            work = sum((b - a) * int(sorted_lens[a:b].max()) for a, b in _cuts(B, n)) / (B * T)
            for kind, plan in (("sorted", sorted_plan), ("gathered", gathered_plan)):
                got = plan(n)
                got = torch.cat(got).index_select(0, back) if kind == "sorted" else got
                ours_s, theirs_s, _ = compare(lambda p=plan, n=n: p(n), one_call, seconds)
                rows.append(
                    {
                        "shape": f"B={B} T={T} d={d}",
                        "plan": f"{n} calls, {kind}",
                        "scores_computed": work,
                        "tiles_s": ours_s,
                        "one_call_s": theirs_s,
                        "ratio": ours_s / theirs_s,
                        "max_abs_diff": float((got - expected).abs().max()),
                    }
                )
    return rows


def _cuts(batch, n):
    """``n`` consecutive ranges of ``range(batch)``, as even as can be."""
    edges = np.linspace(0, batch, n + 1).round().astype(int)
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def with_busy(rows, busy_rows):
    """``rows`` with each plan's ratio beside one busy process (``busy_ratio``)."""
    busy = {(r["shape"], r["plan"]): r["ratio"] for r in busy_rows}
    out = []
    for r in rows:
        r = dict(r)
        diff = r.pop("max_abs_diff")
        r["busy_ratio"], r["max_abs_diff"] = busy.get((r["shape"], r["plan"])), diff
        out.append(r)
    return out


def tiling_table(rows):
    """Markdown: each plan's time against the one call's, idle (and busy)."""
    lines = [
        "| Shape | Plan | Scores computed | Tiles | One call | Ratio | Busy ratio | Max abs diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        busy = r.get("busy_ratio")
        lines.append(
            f"| {r['shape']} | {r['plan']} | {r['scores_computed']:.0%} "
            f"| {r['tiles_s'] * 1e3:.1f} ms | {r['one_call_s'] * 1e3:.1f} ms "
            f"| {r['ratio']:.2f}x | {'–' if busy is None else f'{busy:.2f}x'} "
            f"| {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines)
