"""The human surfaces: every HTML page, the admin and the management commands.

An app without models, above the engine: ``views/`` (the batch pages, the
overview, the workers page, the API tokens page), ``forms.py``, ``live.py``
(live regions), ``uploads.py`` (the manifest upload's size limit),
``templatetags/``, ``admin/`` (one module per model, registered here for the
batches, jobs and operator_api apps' models) and ``management/commands/``.
Each parses its input, calls one function below and renders.
"""
