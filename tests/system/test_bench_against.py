"""`python -m bench --against`: the parsing of what each commit's bench prints
and the medians it takes over the rounds (no bench runs here: that is
minutes per tree; BENCHMARKS.md shows a real run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.against import (
    AgainstError,
    Figure,
    Tree,
    aggregate,
    database_name,
    parse_table,
    pins,
    render,
    rotation,
)
from bench.core import Bench, Sizes, print_table

# What 6db3a96's bench printed for `--only 1,2,3 --runs 1` on 2026-12-03 (its
# first proof under --against): the live lines, the table, the closing line.
OLD_OUTPUT = """\
== 1-3 and 8: claim + complete per second, raw SQL vs model layer vs HTTP.
  raw-SQL limit: claim+complete/s, P=8 = 384/s
  model layer: claim+complete/s, P=8 = 231/s = 0.60 x raw  >= 0.70 x raw MISSED
  HTTP API (gunicorn): claim+complete/s, P=8 = 92/s = 0.24 x raw  >= 0.25 x raw MISSED

#  scenario             figure                 value               target
-  -------------------  ---------------------  ------------------  -------------  ------
1  raw-SQL limit        claim+complete/s, P=8  384/s
2  model layer          claim+complete/s, P=8  231/s = 0.60 x raw  >= 0.70 x raw  MISSED
3  HTTP API (gunicorn)  claim+complete/s, P=8  92/s = 0.24 x raw   >= 0.25 x raw  MISSED

P=8, 1 run(s) per figure, 125 s in all; load average at the end 9.3, 9.1, 5.8 on 2 cores.
"""


def test_the_table_print_table_prints_is_read_back_cell_by_cell(capsys):
    bench = Bench(Sizes(), "postgres://unused", {"1", "2", "5"})
    bench.add("1", "raw-SQL limit", "claim+complete/s, P=8", "1,200/s")
    bench.add(
        "2",
        "model layer",
        "claim+complete/s, P=8",
        "900/s = 0.75 x raw",
        ">= 0.70 x raw",
        True,
    )
    bench.add("5", "idle claim", "server time p50 / p99", "0.9 ms / 1.6 ms")
    bench.add("7", "progress", "counts equal a fresh recount", "yes", "exact", True)
    print_table(bench)

    figures = parse_table(capsys.readouterr().out)

    assert figures == [
        Figure("1", "raw-SQL limit", "claim+complete/s, P=8", "1,200/s"),
        Figure(
            "2",
            "model layer",
            "claim+complete/s, P=8",
            "900/s = 0.75 x raw",
            ">= 0.70 x raw",
        ),
        Figure("5", "idle claim", "server time p50 / p99", "0.9 ms / 1.6 ms"),
        Figure("7", "progress", "counts equal a fresh recount", "yes", "exact"),
    ]
    assert [(f.amount, f.unit) for f in figures] == [
        (1200.0, "/s"),
        (900.0, "/s"),
        (0.9, "ms"),
        (None, ""),
    ]


def test_an_older_commits_output_is_read_past_its_live_lines():
    figures = parse_table(OLD_OUTPUT)

    assert [(f.number, f.name, f.amount, f.target) for f in figures] == [
        ("1", "raw-SQL limit: claim+complete/s, P=8", 384.0, ""),
        ("2", "model layer: claim+complete/s, P=8", 231.0, ">= 0.70 x raw"),
        ("3", "HTTP API (gunicorn): claim+complete/s, P=8", 92.0, ">= 0.25 x raw"),
    ]


def test_output_without_a_table_fails_clearly():
    with pytest.raises(AgainstError, match="no table of figures in its output"):
        parse_table("== 1-3 ...\nTraceback (most recent call last):\n  ...\n")
    renamed = OLD_OUTPUT.replace("#  scenario             figure ", "#  what  fig")
    with pytest.raises(AgainstError, match="no table"):
        parse_table(renamed)


def _round(raw: float, model: float, http: float | None = None) -> list[Figure]:
    figures = [
        Figure("1", "raw-SQL limit", "claim+complete/s, P=8", f"{raw:,.0f}/s"),
        Figure(
            "2",
            "model layer",
            "claim+complete/s, P=8",
            f"{model:,.0f}/s = {model / raw:.2f} x raw",
            ">= 0.70 x raw",
        ),
    ]
    if http is not None:
        figures.append(
            Figure(
                "3",
                "HTTP API (gunicorn)",
                "claim+complete/s, P=8",
                f"{http:.0f}/s = {http / raw:.2f} x raw",
                ">= 0.25 x raw",
            )
        )
    return figures


def test_ratios_are_taken_within_each_round_then_the_median():
    # A slow spell hits the new tree's raw run in round 2: the ratio of the
    # medians (800 / 1000 = 0.80) would flatter it; each round's own ratio
    # does not (0.70, 1.00, 0.72: median 0.72).
    rounds = [
        {"abc1234+dirty": _round(1000, 700, 240), "6db3a96": _round(1000, 600, 200)},
        {"abc1234+dirty": _round(800, 800, 200), "6db3a96": _round(1100, 660, 230)},
        {"abc1234+dirty": _round(1250, 900, 300), "6db3a96": _round(900, 560, 190)},
    ]

    lines = aggregate(rounds, ["abc1234+dirty", "6db3a96"], {"1", "2", "3"})

    assert [(line.key, line.tree) for line in lines] == [
        (("1", 0), "abc1234+dirty"),
        (("1", 0), "6db3a96"),
        (("2", 0), "abc1234+dirty"),
        (("2", 0), "6db3a96"),
        (("3", 0), "abc1234+dirty"),
        (("3", 0), "6db3a96"),
    ]
    model, old_model = lines[2], lines[3]
    assert model.median == 800.0
    assert model.ratios == [0.7, 1.0, 0.72]
    assert model.ratio == 0.72
    assert (model.target, model.verdict) == (">= 0.70 x raw", "ok")
    assert old_model.ratios == [0.6, 0.6, 0.62]
    assert (old_model.target, old_model.verdict) == ("", "")
    http = lines[4]
    assert (http.median, http.ratio) == (240.0, 0.24)
    assert http.verdict == "MISSED"
    assert lines[0].ratios == []

    assert render(lines) == EXPECTED_TABLE


EXPECTED_TABLE = """\
#  figure                                      tree           median   x row 1  per round              target
-  ------------------------------------------  -------------  -------  -------  ---------------------  -------------  ------
1  raw-SQL limit: claim+complete/s, P=8        abc1234+dirty  1,000/s           1,000/s 800/s 1,250/s
                                               6db3a96        1,000/s           1,000/s 1,100/s 900/s
2  model layer: claim+complete/s, P=8          abc1234+dirty  800/s    0.72     0.70 1.00 0.72         >= 0.70 x raw  ok
                                               6db3a96        600/s    0.60     0.60 0.60 0.62
3  HTTP API (gunicorn): claim+complete/s, P=8  abc1234+dirty  240/s    0.24     0.24 0.25 0.24         >= 0.25 x raw  MISSED
                                               6db3a96        200/s    0.21     0.20 0.21 0.21"""


def test_a_row_missing_from_a_tree_fails_naming_the_tree_and_round():
    rounds = [
        {"new": _round(1000, 700, 250), "old": _round(1000, 600, 200)},
        {"new": _round(1000, 700, 250), "old": _round(1000, 600)},
    ]

    with pytest.raises(AgainstError, match=r"^old, round 2: no row 3 in its table$"):
        aggregate(rounds, ["new", "old"], {"1", "2", "3"})


def test_values_that_are_not_figures_are_shown_as_printed():
    yes = [Figure("7", "progress", "counts equal", "yes", "exact")]
    lines = aggregate([{"new": yes}, {"new": yes}], ["new"], {"7"})

    assert [(line.value(), line.ratio, line.rounds()) for line in lines] == [
        ("yes", None, "")
    ]


def test_each_tree_gets_a_database_named_after_it():
    url = "postgres://root@127.0.0.1:5432/recall_benchcmp"
    assert database_name(url, "a57073c+dirty") == "recall_benchcmp_a57073c_dirty"
    assert database_name(url + "?sslmode=disable", "6db3a96") == (
        "recall_benchcmp_6db3a96"
    )


def test_pins_are_the_version_lines_of_every_requirement_file(tmp_path):
    (tmp_path / "requirements.txt").write_text(
        "# Runtime\nDjango==5.2.19\npsycopg[binary] == 3.3.9  # the driver\n"
    )
    (tmp_path / "requirements-dev.txt").write_text(
        "-r requirements.txt\nruff==0.17.6\n"
    )
    (tmp_path / "other.txt").write_text("left==1\n")

    assert pins(tmp_path) == {
        "django==5.2.19",
        "psycopg[binary]==3.3.9",
        "ruff==0.17.6",
    }


def test_a_table_without_targets_or_verdicts_is_read_too(capsys):
    bench = Bench(Sizes(), "postgres://unused", {"1"})
    bench.add("1", "raw-SQL limit", "claim+complete/s, P=2", "95/s")
    print_table(bench)

    assert parse_table(capsys.readouterr().out) == [
        Figure("1", "raw-SQL limit", "claim+complete/s, P=2", "95/s")
    ]


def test_each_round_starts_one_tree_later():
    trees = [Tree(label, Path("."), "python") for label in ("new", "a", "b")]

    orders = [[t.label for t in rotation(trees, r)] for r in range(4)]

    assert orders == [
        ["new", "a", "b"],
        ["a", "b", "new"],
        ["b", "new", "a"],
        ["new", "a", "b"],
    ]


def test_a_ratio_the_bench_printed_is_preferred_to_one_of_rounded_rates():
    # 137 / 219 = 0.6256: the bench's own 0.62 came from the unrounded rates.
    printed = [
        Figure("1", "raw-SQL limit", "claim+complete/s, P=8", "219/s"),
        Figure("2", "model layer", "claim+complete/s, P=8", "137/s = 0.62 x raw"),
        Figure("4", "peer: q2", "no-op jobs/s", "125/s = 0.08 x raw; Recall 9.84 x"),
        Figure("8", "hot rows", "HTTP 1 vs 100 batches", "40/s vs 42/s = 0.95"),
    ]

    lines = aggregate([{"new": printed}], ["new"], {"1", "2"})

    assert [(line.key[0], line.ratios) for line in lines] == [
        ("1", []),
        ("2", [0.62]),
        ("4", [0.08]),
        ("8", [40 / 219]),
    ]
