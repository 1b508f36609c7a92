"""Seeing the whole system: Prometheus metrics, the fleet overview page.

``metrics``: ``/metrics`` (database figures read at scrape time, plus the worker
API's per-process request metrics); ``multiprocess``: those request metrics
under gunicorn's several processes; ``views``: the overview page. The figures
themselves are read by ``jobs.fleet``.
"""
