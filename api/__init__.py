"""The machine surfaces: the worker API, the Operator API and their contract.

An app without models, above the engine: ``worker_views.py`` (the worker
API), ``operator_views.py`` (the Operator API), ``jsonapi.py`` (the error
shape and JSON body checks both share), ``waiter.py`` (a long-poll claim
handed over to the server), ``worker_limits.py`` (per-worker request rate
and waiting claims, counted across the server's processes),
``request_metrics.py`` (the worker API's request metrics) and the one OpenAPI
document (``openapi.py``, with the worker API's part in
``worker_openapi.py``). The API token models stay in ``operator_api``.
"""
