"""The policies: what Recall decides, above the rows and the transitions.

An app without models, between the transition layer (``jobs/``) and the doors
(``api/``, ``console/``): batch intake (``manifests.py``, manifest and item
parsing; ``background_intake.py``, large uploads read in the background),
``progress.py`` (state, throughput and ETA, pure functions), ``archive.py``
(a purged batch's archive), ``sweep.py``, ``reconcile.py``, ``retention.py``
(which batches a purge deletes), ``checks.py`` (the invariants), ``fleet.py``
(the whole fleet right now, read-only), ``longpoll.py`` (the waker's probe),
``webhooks/`` (delivery, destinations, endpoints, signatures) and
``tasks.py``, the django-q2 task functions. Every write goes through
``jobs.transitions``.
"""
