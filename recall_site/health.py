"""Health probes for load balancers and Kubernetes.

* ``/healthz``: the process is alive (no database access).
* ``/readyz``: the database answers, and the sweeper ran recently. 503 with the
  reasons otherwise.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse

from jobs import transitions
from jobs.models import SweepState


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    reasons: list[str] = []
    last_sweep = None
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        state = SweepState.objects.filter(pk=SweepState.SINGLETON).first()
        last_sweep = state.last_finished_at if state else None
    except DatabaseError as error:
        reasons.append(f"database unreachable: {error.__class__.__name__}")
    else:
        limit = timedelta(seconds=settings.RECALL_READY_MAX_SWEEP_AGE_SECONDS)
        now = transitions.now()  # the sweep's time is the database's too
        if last_sweep is None:
            reasons.append(
                "no sweep has finished yet (is the django-q2 cluster running?)"
            )
        elif now - last_sweep > limit:
            age = int((now - last_sweep).total_seconds())
            reasons.append(
                f"the last sweep finished {age} s ago (limit "
                f"{int(limit.total_seconds())} s): is the django-q2 cluster running?"
            )
    body = {
        "status": "unavailable" if reasons else "ok",
        "last_sweep": last_sweep.isoformat() if last_sweep else None,
    }
    if reasons:
        body["reasons"] = reasons
    response = JsonResponse(body, status=503 if reasons else 200)
    response["Cache-Control"] = "no-store"
    return response
