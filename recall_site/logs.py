"""Log formats: plain text (the default) or one JSON object per line.

``LOG_FORMAT=json`` makes every line that gunicorn (its error and access logs),
the web app, the django-q2 cluster and the management commands log a JSON
object on stdout, for log shippers such as Loki or Vector: ``time`` (UTC, ISO
8601), ``level``, ``logger``, ``message``, ``pid``, an ``exception`` when there
is one, and the ids of a lease transition when the record carries them
(``log.info(..., extra={"job": ..., "attempt": ..., "worker": ..., "batch":
...})``), so one job's life can be followed with ``grep '"job": 42'``.

This module imports nothing but the standard library: gunicorn's master loads
it before Django is set up.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

FORMATS = ("text", "json")
# The ids a lease transition passes in ``extra``; no other extra key is copied.
ID_FIELDS = ("job", "attempt", "worker", "batch")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FORMATTER = {"()": "recall_site.logs.JsonFormatter"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for key in ID_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # ASCII only: a stray surrogate in a message cannot break the stream.
        return json.dumps(entry, default=str)


def django_logging(log_format: str, level: str) -> dict:
    """``settings.LOGGING``: text on stderr (as ever), or JSON on stdout."""
    json_lines = log_format == "json"
    handler: dict = {
        "class": "logging.StreamHandler",
        "formatter": "json" if json_lines else "plain",
    }
    if json_lines:
        handler["stream"] = "ext://sys.stdout"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": TEXT_FORMAT}, "json": JSON_FORMATTER},
        "handlers": {"console": handler},
        "root": {"handlers": ["console"], "level": level},
        "loggers": {"django.db.backends": {"level": "WARNING"}},
    }


def gunicorn_logging(level: str, access_log: str) -> dict:
    """gunicorn's ``logconfig_dict`` for JSON lines: its error log, its access
    log (``-``: stdout, a path: that file, empty: none) and the root logger."""
    handlers: dict = {
        "stdout": {
            "class": "logging.StreamHandler",
            "formatter": "json",
            "stream": "ext://sys.stdout",
        }
    }
    access = []
    if access_log == "-":
        access = ["stdout"]
    elif access_log:
        handlers["access_file"] = {
            "class": "logging.FileHandler",
            "formatter": "json",
            "filename": access_log,
        }
        access = ["access_file"]
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": JSON_FORMATTER},
        "handlers": handlers,
        "root": {"level": level, "handlers": ["stdout"]},
        "loggers": {
            "gunicorn.error": {
                "level": "INFO",
                "handlers": ["stdout"],
                "propagate": False,
                "qualname": "gunicorn.error",
            },
            "gunicorn.access": {
                "level": "INFO",
                "handlers": access,
                "propagate": False,
                "qualname": "gunicorn.access",
            },
        },
    }
