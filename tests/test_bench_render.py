"""The performance guide's tables are one ``bench --json`` run, rendered:
whatever sections and columns the run has, with its date, load and machine."""

import json
from pathlib import Path

import pytest

from attention_multi.cli.bench import render

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "guide" / "performance.md"
RUN = {
    "machine": {
        "date": "2026-11-27 03:00 UTC",
        "load_average_start": [1.0, 2.5, 3.25],
        "load_average_end": [1.5, 2.0, 3.0],
        "cpu": "AMD EPYC",
        "cores": 2,
        "versions": {"python": "3.11.7", "torch": "2.13.0"},
    },
    "torch_threads": 2,
    "rows": [
        {
            "key": "torch-dot",
            "backend": "torch",
            "measured": "DotProductAttention",
            "ours_s": 0.00561,
            "theirs_s": 0.00726,
            "parallel_regions": 3,
        }
    ],
    "small": [
        {"backend": "numpy", "ours_s": 1.4e-5, "theirs_s": 1.3e-5, "ratio": 1.07, "met": False}
    ],
    "packed": [["torch", "forward", "flex", 0.18, 0.255, 0.71, 0.115, None, [12, 1]]],
    "a_new_table": [{"busy_ratio": 1.25, "note": "a | b"}],
    "ring_balance": [
        {
            "layout": "zigzag",
            "length": 4096,
            "size": 2,
            "ranks": [
                {
                    "rank": 1,
                    "seconds": 2.5,
                    "wall": 2.6,
                    "steps": [
                        {
                            "step": 0,
                            "scores": 3_000_000,
                            "calls": 5,
                            "compute_s": 1.25,
                            "exchange_s": 0.01,
                        },
                        {
                            "step": 1,
                            "scores": 1_500_000,
                            "calls": 2,
                            "compute_s": 0.75,
                            "exchange_s": 0.02,
                        },
                    ],
                }
            ],
        }
    ],
    "long": [],
}


def test_every_section_and_column_of_the_run_is_rendered():
    text = render.render(RUN)
    first = text.splitlines()[0]
    assert first.startswith("Measured on 2026-11-27 03:00 UTC, load average (1, 5, 15 min) ")
    assert "start 1.00, 2.50, 3.25; end 1.50, 2.00, 3.00" in first and "AMD EPYC, 2 cores" in first
    assert "| backend | measured | ours | theirs | ratio | parallel regions |" in text
    assert (
        "| torch | DotProductAttention | 5.61 ms | 7.26 ms | 0.77x | 3 |" in text
    )  # ratio derived
    assert "| numpy | 14 µs | 13 µs | 1.07x | NO |" in text  # µs, the bench's ratio, met
    assert "| torch | forward | flex | 180 ms | 255 ms | 0.71x | 11.5% | – |" in text  # a list row
    assert "### a_new_table" in text and "| 1.25x | a \\| b |" in text  # unknown: as it is
    assert "torch-dot" not in text and "### A long sequence" not in text  # ids, empty sections
    # the ring balance: a row per participant, its steps summed
    assert (
        "| layout | length | processes | participant | scores computed (M) | calls "
        "| compute per step | exchange waits | time |" in text
    )
    assert "| zigzag | 4096 | 2 | 1 | 4.5 | 7 | 1.25 s, 750 ms | 30 ms | 2.5 s |" in text


def test_the_page_is_replaced_between_its_markers_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"before\n{render.BEGIN}\nold tables\n{render.END}\nafter\n")
    run = tmp_path / "run.json"
    run.write_text(json.dumps(RUN))
    assert render.main([str(run), str(page)]) == 0
    text = page.read_text()
    assert text.startswith(f"before\n{render.BEGIN}\nMeasured on ") and text.endswith(
        f"{render.END}\nafter\n"
    )
    assert "old tables" not in text
    page.write_text("no markers\n")
    assert render.main([str(run), str(page)]) == 1 and page.read_text() == "no markers\n"
    with pytest.raises(ValueError, match="needs one"):
        render.replace_between_markers("x", "y")


def test_the_performance_guide_holds_one_rendered_run():
    text = PAGE.read_text()
    assert text.count(render.BEGIN) == 1 and text.count(render.END) == 1
    tables = text.split(render.BEGIN, 1)[1].split(render.END, 1)[0].strip()
    assert tables.startswith("Measured on ") and "load average" in tables.splitlines()[0]
    assert "python -m attention_multi.cli.bench.render" in text
    # outside the markers no table of measured times: they are not edited by hand
    outside = text.replace(tables, "")
    assert not [line for line in outside.splitlines() if line.startswith("|") and "s |" in line]


def test_tiling_bound_plans_agree_with_the_one_call():
    """The tiling table's plans (plain torch) compute the one SDPA call's output,
    over the share of its scores their groups hold."""
    pytest.importorskip("torch")
    from attention_multi.cli.bench.tiling import tiling_rows, tiling_table, with_busy

    rows = tiling_rows((6, 64, 8), 0.01)
    assert [r["plan"] for r in rows] == [
        "2 calls, sorted",
        "2 calls, gathered",
        "4 calls, sorted",
        "4 calls, gathered",
    ]
    for r in rows:
        assert r["max_abs_diff"] < 1e-5, r
        assert 0.25 <= r["scores_computed"] <= 1 and r["ratio"] > 0, r
    assert rows[2]["scores_computed"] <= rows[0]["scores_computed"]  # (finer groups)
    busy = with_busy(rows, [dict(r, ratio=2.0) for r in rows[:1]])
    assert [r["busy_ratio"] for r in busy] == [2.0, None, None, None]
    text = tiling_table(busy)
    assert "| B=6 T=64 d=8 | 2 calls, sorted |" in text and "| 2.00x |" in text
    assert render.TITLES["tiling"] in render.render({"tiling": busy})
