"""Real threads started together on the real database, for races."""

from __future__ import annotations

import threading

from django.db import connections

THREADS = 8


def run_threads(target, n: int = THREADS) -> list:
    """Start n threads on ``target(i, barrier)`` together; return their results."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def body(i: int) -> None:
        try:
            results[i] = target(i, barrier)
        except BaseException as error:  # surfaced below, with its traceback
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return results
