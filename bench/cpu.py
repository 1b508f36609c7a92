"""CPU time of a process tree, from /proc: what the benchmark charges to the
server (gunicorn and its workers, PostgreSQL and its backends)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(root: int) -> float:
    """CPU time (s) of a process and all its descendants, the exited ones too
    (a parent's cutime/cstime holds its reaped children's)."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # ppid; utime + stime + cutime + cstime
        table[int(entry)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            total += table[pid][1]
            stack.extend(children.get(pid, []))
    return total / tick
