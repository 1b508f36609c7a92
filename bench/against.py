"""``--against COMMIT[,COMMIT...]``: the current tree and earlier commits, each
running its own bench, interleaved in one run.

A target such as "the model layer at 0.70 x raw, and no slower than 6db3a96"
counts only when before and after are measured in the same run: on a shared
machine the load changes from one hour to the next, and a ratio taken an hour
apart compares two machines. So each selected row is run round-robin: in
every round, each tree (the current one first, then the commits, the order
turning by one each round so no tree always runs first) runs *its own*
``python -m bench --only ... --runs 1`` in a subprocess; its printed table is
parsed, and the medians over the rounds are printed side by side. A ratio to
row 1 is taken within each round (the same tree's raw-SQL limit, a minute
apart) and then the median of those is printed.

Each commit is checked out under ``var/bench-against/<commit>`` (a clone
sharing this repository's objects, kept for the next run). It runs with this
tree's virtualenv when every requirement its ``requirements*.txt`` pin is
pinned the same here (extra packages installed here are never imported by it),
else with a ``.venv`` of its own built by its own Makefile (``make
.venv/.dev``). Each child bench starts its own private PostgreSQL server, as
``make bench`` does; with ``--database-url`` every tree gets a database of its
own on that server (the URL's name suffixed with the tree's label), created
fresh before each of its runs and dropped at the end.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKOUTS = ROOT / "var" / "bench-against"


class AgainstError(Exception):
    """A tree could not be prepared, or its bench printed no usable figure."""


# --- Parsing what a bench prints ---------------------------------------------------

_AMOUNT = re.compile(r"^\s*(\d[\d,]*(?:\.(\d+))?)(\s*)([^\s=;,()]*)")


@dataclass(frozen=True)
class Figure:
    """One line of a bench's final table."""

    number: str
    scenario: str
    figure: str
    value: str
    target: str = ""

    @property
    def name(self) -> str:
        return f"{self.scenario}: {self.figure}"

    @property
    def amount(self) -> float | None:
        """The figure the value starts with (``1,234/s = 0.56 x raw`` gives
        1234.0), or None for a value that does not start with one (``yes``)."""
        match = _AMOUNT.match(self.value)
        return float(match.group(1).replace(",", "")) if match else None

    @property
    def unit(self) -> str:
        """What follows that figure (``/s``, ``ms``, ``%`` ...)."""
        match = _AMOUNT.match(self.value)
        return match.group(4) if match else ""

    @property
    def spaced(self) -> bool:
        match = _AMOUNT.match(self.value)
        return bool(match and match.group(3))

    @property
    def decimals(self) -> int:
        match = _AMOUNT.match(self.value)
        return len(match.group(2) or "") if match else 0


def parse_table(output: str) -> list[Figure]:
    """The rows of the last table in ``output``, as every commit's
    ``print_table`` prints it: a header (``#  scenario  figure  value  target``),
    a line of dashes under each column (which gives the columns' starts, so a
    cell may contain spaces), then one line per figure up to a blank line."""
    lines = output.splitlines()
    headers = [
        i
        for i, line in enumerate(lines[:-1])
        if re.match(r"#\s+scenario\s+figure\s+value", line)
        and lines[i + 1].startswith("-")
    ]
    if not headers:
        raise AgainstError("no table of figures in its output")
    start = headers[-1]
    columns = [m.start() for m in re.finditer(r"-+", lines[start + 1])]
    names = [_cell(lines[start], columns, i) for i in range(len(columns))]
    wanted = ("#", "scenario", "figure", "value")
    if tuple(names[:4]) != wanted:
        raise AgainstError(f"its table's columns are {names}, not {list(wanted)}")
    figures = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = [_cell(line, columns, i) for i in range(len(columns))]
        figures.append(
            Figure(
                number=cells[0],
                scenario=cells[1],
                figure=cells[2],
                value=cells[3],
                target=cells[4] if len(cells) > 4 and names[4] == "target" else "",
            )
        )
    return figures


def _cell(line: str, columns: list[int], i: int) -> str:
    end = columns[i + 1] if i + 1 < len(columns) else None
    return line[columns[i] : end].strip()


Key = tuple[str, int]


def keyed(figures: Iterable[Figure]) -> dict[Key, Figure]:
    """Figures by row number and place within the row (row 5 prints two lines:
    ``("5", 0)`` and ``("5", 1)``), which stay the same across commits where
    the wording of a figure may not."""
    seen: dict[str, int] = {}
    out = {}
    for figure in figures:
        place = seen.get(figure.number, 0)
        seen[figure.number] = place + 1
        out[(figure.number, place)] = figure
    return out


# --- Aggregating the rounds ----------------------------------------------------------


@dataclass
class Line:
    """One row of one tree, over all the rounds."""

    key: Key
    tree: str
    name: str
    figures: list[Figure]
    ratios: list[float] = field(default_factory=list)  # to row 1, per round
    target: str = ""
    verdict: str = ""

    @property
    def median(self) -> float | None:
        amounts = [f.amount for f in self.figures]
        if not amounts or None in amounts:
            return None
        return statistics.median(a for a in amounts if a is not None)

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def value(self) -> str:
        """The median with the unit the bench printed, or the printed values
        themselves where they are not figures."""
        median = self.median
        if median is None:
            return " / ".join(dict.fromkeys(f.value for f in self.figures))
        return _format(median, self.figures[0])

    def rounds(self) -> str:
        if self.ratios:
            return " ".join(f"{r:.2f}" for r in self.ratios)
        if self.median is None:
            return ""
        return " ".join(_format(f.amount or 0.0, f) for f in self.figures)


def _format(amount: float, like: Figure) -> str:
    decimals = like.decimals
    number = f"{amount:,.{decimals}f}"
    return number + (" " if like.spaced else "") + like.unit


def aggregate(
    rounds: Sequence[dict[str, list[Figure]]],
    trees: Sequence[str],
    wanted: set[str],
) -> list[Line]:
    """Lines per row (in row order), then per tree (in ``trees``' order), from
    each round's parsed figures of each tree. Every row in ``wanted`` must be
    in every tree's every round; the first tree's targets are kept (the
    current tree's), with a verdict where the target is a ratio to raw."""
    if not rounds:
        raise AgainstError("no rounds were run")
    by_round: list[dict[str, dict[Key, Figure]]] = []
    for r, measured in enumerate(rounds, 1):
        per_tree = {}
        for tree in trees:
            figures = keyed(measured[tree])
            missing = sorted(wanted - {number for number, _ in figures}, key=_order)
            if missing:
                raise AgainstError(
                    f"{tree}, round {r}: no row {', '.join(missing)} in its table"
                )
            per_tree[tree] = figures
        by_round.append(per_tree)
    keys = sorted(
        {
            key
            for per_tree in by_round
            for figures in per_tree.values()
            for key in figures
        },
        key=lambda k: (_order(k[0]), k[1]),
    )
    lines = []
    for key in keys:
        for i, tree in enumerate(trees):
            present = [p[tree][key] for p in by_round if key in p[tree]]
            if not present:
                continue
            line = Line(key, tree, present[0].name, present)
            if key != ("1", 0):
                line.ratios = _ratios(by_round, tree, key)
            if i == 0:
                line.target = present[0].target
                line.verdict = _verdict(line)
            lines.append(line)
    return lines


_X_RAW = re.compile(r"=\s*(\d+(?:\.\d+)?)\s*x raw\b")


def _ratios(
    by_round: list[dict[str, dict[Key, Figure]]], tree: str, key: Key
) -> list[float]:
    """This row over row 1 of the same tree in the same round, for rates
    (``/s``) only: empty unless every round has both. Where the bench printed
    the ratio itself (``137/s = 0.62 x raw``), that one, taken from figures
    not yet rounded to whole rates (137 / 219 would say 0.63)."""
    ratios = []
    for per_tree in by_round:
        figure, raw = per_tree[tree].get(key), per_tree[tree].get(("1", 0))
        if figure is None or raw is None or figure.amount is None or not raw.amount:
            return []
        if figure.unit != "/s" or raw.unit != "/s":
            return []
        printed = _X_RAW.search(figure.value)
        ratios.append(
            float(printed.group(1)) if printed else figure.amount / raw.amount
        )
    return ratios


def _verdict(line: Line) -> str:
    match = re.fullmatch(r"(>=|<=)\s*([\d.]+)\s*x raw", line.target)
    if not match or line.ratio is None:
        return ""
    bound = float(match.group(2))
    ok = line.ratio >= bound if match.group(1) == ">=" else line.ratio <= bound
    return "ok" if ok else "MISSED"


def _order(number: str) -> tuple[int, str]:
    return (int(number), "") if number.isdigit() else (10**6, number)


def render(lines: list[Line]) -> str:
    """One table: per row, one line per tree."""
    header = ("#", "figure", "tree", "median", "x row 1", "per round", "target", "")
    table = [header]
    previous: Key | None = None
    for line in lines:
        first = line.key != previous
        previous = line.key
        table.append(
            (
                line.key[0] if first else "",
                line.name if first else "",
                line.tree,
                line.value(),
                "" if line.ratio is None else f"{line.ratio:.2f}",
                line.rounds(),
                line.target,
                line.verdict,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    out = []
    for i, row in enumerate(table):
        cells = (c.ljust(w) for c, w in zip(row, widths, strict=True))
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths).rstrip())
    return "\n".join(out)


# --- Preparing the trees -------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    label: str  # short commit, "+dirty" for a current tree with changes
    path: Path
    python: str


def _git(*args: str, cwd: Path = ROOT) -> str:
    result = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise AgainstError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout.strip()


def current_tree() -> Tree:
    label = _git("rev-parse", "--short", "HEAD")
    if _git("status", "--porcelain", "--untracked-files=no"):
        label += "+dirty"
    return Tree(label, ROOT, sys.executable)


def pins(directory: Path) -> set[str]:
    """What the requirement files of a tree pin (``name==version`` lines,
    lowercased, without comments, includes or options)."""
    found = set()
    for path in sorted(directory.glob("requirements*.txt")):
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip().replace(" ", "").lower()
            if line and not line.startswith("-"):
                found.add(line)
    return found


def checkout(commit: str) -> Tree:
    """``var/bench-against/<commit>``, cloned (sharing this repository's
    objects) and checked out at ``commit`` if it is not already, with the
    Python it runs with."""
    try:
        sha = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except AgainstError:
        raise AgainstError("no such commit in this repository") from None
    label = _git("rev-parse", "--short", sha)
    path = CHECKOUTS / label
    if not (path / ".git").exists():
        CHECKOUTS.mkdir(parents=True, exist_ok=True)
        print(f"{label}: cloning into {path.relative_to(ROOT)}", flush=True)
        _git("clone", "--quiet", "--shared", "--no-checkout", str(ROOT), str(path))
    if _git("rev-parse", "HEAD", cwd=path) != sha or _git(
        "status", "--porcelain", "--untracked-files=no", cwd=path
    ):
        _git("checkout", "--quiet", "--force", "--detach", sha, cwd=path)
    return Tree(label, path, _python(label, path))


def _python(label: str, path: Path) -> str:
    """This tree's Python when it pins nothing this tree does not pin the
    same, else the commit's own virtualenv, built by its own Makefile."""
    theirs, ours = pins(path), pins(ROOT)
    if theirs <= ours:
        print(f"{label}: its requirements are a subset of ours: this .venv")
        return sys.executable
    own = path / ".venv" / "bin" / "python"
    if not (path / ".venv" / ".dev").exists():
        differ = ", ".join(sorted(theirs - ours))
        print(f"{label}: pins {differ}: make .venv/.dev there", flush=True)
        made = subprocess.run(["make", ".venv/.dev"], cwd=path, check=False)
        if made.returncode:
            raise AgainstError(f"{label}: make .venv/.dev failed in {path}")
    return str(own)


# --- Running -------------------------------------------------------------------------


@dataclass
class Options:
    only: str
    runs: int
    processes: int
    quick: bool = False
    database_url: str | None = None
    extra: list[str] = field(default_factory=list)  # passed through as is


def database_name(base_url: str, label: str) -> str:
    """The URL's database name suffixed with the tree's label, in the
    characters a PostgreSQL name takes unquoted."""
    name = base_url.rsplit("/", 1)[1].split("?", 1)[0]
    return f"{name}_{re.sub(r'[^a-z0-9_]', '_', label.lower())}"


def _fresh_database(base_url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(base_url, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}"')
        connection.execute(f'CREATE DATABASE "{name}"')
    return f"{base_url.rsplit('/', 1)[0]}/{name}"


def _drop_database(base_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(base_url, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}"')


def run_once(tree: Tree, options: Options, log: Path) -> list[Figure]:
    """One ``--runs 1`` bench of ``tree``; its output kept in ``log``."""
    command = [
        tree.python, "-m", "bench", "--only", options.only, "--runs", "1",
        "--processes", str(options.processes), *options.extra,
    ]  # fmt: skip
    if options.quick:
        command.append("--quick")
    if options.database_url:
        name = database_name(options.database_url, tree.label)
        command += ["--database-url", _fresh_database(options.database_url, name)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        child = subprocess.Popen(
            command, cwd=tree.path, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            code = child.wait()
        finally:
            if child.poll() is None:  # interrupted: let it stop its servers
                child.terminate()
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
    output = log.read_text()
    if code:
        tail = "\n".join(output.splitlines()[-15:])
        raise AgainstError(f"{tree.label}: bench exited {code} (see {log}):\n{tail}")
    try:
        return parse_table(output)
    except AgainstError as error:
        raise AgainstError(f"{tree.label}: {error} (see {log})") from None


def run(
    trees: Sequence[Tree], options: Options, stamp: str
) -> list[dict[str, list[Figure]]]:
    """``options.runs`` rounds; each runs every tree once, starting one later
    than the round before; each run's output in ``logs/<stamp>-...``."""
    rounds = []
    for r in range(options.runs):
        measured = {}
        for tree in rotation(trees, r):
            started = time.monotonic()
            log = CHECKOUTS / "logs" / f"{stamp}-round{r + 1}-{_safe(tree.label)}.log"
            figures = run_once(tree, options, log)
            measured[tree.label] = figures
            took = time.monotonic() - started
            shown = "; ".join(f"{f.number}: {f.value}" for f in figures)
            print(
                f"round {r + 1}/{options.runs}, {tree.label} ({took:.0f} s): {shown}",
                flush=True,
            )
        rounds.append(measured)
    return rounds


def rotation(trees: Sequence[Tree], r: int) -> list[Tree]:
    """Round ``r``'s order (from 0): the trees, starting ``r`` places on, so
    each runs first, second ... in turn (the slot after a tree's teardown, or
    after a checkpoint another left behind, is no one tree's)."""
    return [trees[(r + i) % len(trees)] for i in range(len(trees))]


def _safe(label: str) -> str:
    return label.replace("+", "-")


def main(commits: str, options: Options) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    wanted = {n.strip() for n in options.only.split(",") if n.strip()}
    current = current_tree()
    trees = [current]
    for commit in (c.strip() for c in commits.split(",") if c.strip()):
        try:
            tree = checkout(commit)
        except AgainstError as error:
            raise AgainstError(f"--against {commit}: {error}") from None
        if tree.label in {t.label for t in trees}:
            raise AgainstError(f"--against {commit}: {tree.label} is measured already")
        trees.append(tree)
    if len(trees) == 1:
        raise AgainstError("--against names no commit")
    labels = [t.label for t in trees]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        rounds = run(trees, options, stamp)
    finally:
        if options.database_url:
            for label in labels:
                _drop_database(
                    options.database_url, database_name(options.database_url, label)
                )
    lines = aggregate(rounds, labels, wanted)
    print()
    print(render(lines))
    load = ", ".join(f"{n:.1f}" for n in os.getloadavg())
    print(
        f"\n{len(rounds)} round(s), each tree's own bench with --runs 1, "
        f"P={options.processes}, interleaved; medians over the rounds, x row 1 "
        f"taken within each round. {time.monotonic() - started:.0f} s in all; "
        f"load average at the end {load} on {os.cpu_count()} cores. Each run's "
        f"output: {(CHECKOUTS / 'logs').relative_to(ROOT)}/{stamp}-*."
    )
    return 0
