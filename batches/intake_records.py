"""Background intakes: a manifest uploaded through the web form, waiting for or
going through intake in the django-q2 cluster (engine/background_intake.py).

The manifest travels in the database (IntakeChunk rows of about a megabyte), so
the cluster may run on another host than the web server that received it. The
Intake row is what the operator's page shows: how far the check has got, then
the batch, or every problem with its line number.

These models live in their own module (imported by BatchesConfig.ready), apart
from the batch records in batches/models.py.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from .json_limits import StoredJSONDecoder
from .models import Batch


class IntakeStatus(models.TextChoices):
    QUEUED = "queued"  # stored; waiting for the cluster
    RUNNING = "running"  # the cluster is checking or writing it
    DONE = "done"  # the batch exists (``batch``)
    FAILED = "failed"  # nothing was created (``errors`` or ``detail`` say why)


class IntakePhase(models.TextChoices):
    CHECKING = "checking"  # reading every line for problems
    WRITING = "writing"  # creating the items and jobs, in one transaction


class Intake(models.Model):
    name = models.CharField(max_length=200)
    # The batch's share of the workers, as asked on the form (fair share).
    priority = models.SmallIntegerField(default=0)
    weight = models.PositiveSmallIntegerField(default=1)
    max_in_flight = models.PositiveIntegerField(null=True, blank=True)
    # The worker labels the batch will require (``batches.labels``), as asked.
    requires = models.JSONField(default=dict, blank=True, decoder=StoredJSONDecoder)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(default=timezone.now)
    # Every write bumps it: a running intake that stops moving was interrupted.
    updated_at = models.DateTimeField(default=timezone.now)
    status = models.CharField(
        max_length=10, choices=IntakeStatus.choices, default=IntakeStatus.QUEUED
    )
    phase = models.CharField(
        max_length=10, choices=IntakePhase.choices, default=IntakePhase.CHECKING
    )
    attempts = models.PositiveSmallIntegerField(default=0)
    size_bytes = models.BigIntegerField(default=0)
    checked_bytes = models.BigIntegerField(default=0)
    checked_lines = models.PositiveIntegerField(default=0)
    batch = models.OneToOneField(
        Batch, null=True, blank=True, on_delete=models.SET_NULL, related_name="intake"
    )
    # The first problems, as the form shows them: [{"line": n, "message": "..."}].
    errors = models.JSONField(default=list, blank=True, decoder=StoredJSONDecoder)
    total_errors = models.PositiveIntegerField(default=0)
    detail = models.TextField(blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=IntakeStatus.values),
                name="intake_status_valid",
            ),
            models.CheckConstraint(
                condition=Q(phase__in=IntakePhase.values), name="intake_phase_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"intake {self.pk} ({self.name}): {self.status}"

    @property
    def percent_checked(self) -> float:
        if not self.size_bytes:
            return 0.0
        return round(
            100 * min(self.checked_bytes, self.size_bytes) / self.size_bytes, 1
        )


class IntakeChunk(models.Model):
    """One piece of an uploaded manifest, in order (``seq``)."""

    intake = models.ForeignKey(Intake, on_delete=models.CASCADE, related_name="chunks")
    seq = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["intake", "seq"], name="intake_chunk_seq")
        ]

    def __str__(self) -> str:
        return f"intake {self.intake_id} chunk {self.seq}"
