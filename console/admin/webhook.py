"""The admin's webhooks: endpoints (the secret shown once, disable, re-enable,
rotate the secret, a test event), the events of the outbox (redeliver), and
every delivery attempt."""

from __future__ import annotations

import json
from datetime import timedelta
from weakref import WeakKeyDictionary

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers
from django.utils.text import Truncator

from batches.models import Batch
from console.admin.support import (
    SAMPLE_SIZE,
    BatchFilter,
    BigTableAdmin,
    Confirmation,
    ReadOnlyInline,
    as_id,
    changelist_link,
    is_confirmed,
    link_to_id,
    log_changes,
    render_confirmation,
)
from engine.webhooks.endpoints import EndpointInvalid, check_url, parse_events
from jobs import transitions
from jobs.models import (
    SUBSCRIBABLE_EVENTS,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    url_origin,
)

# The secret of an endpoint just added, from save_model to response_add of the
# same request (never stored anywhere else in clear).
_new_secrets: WeakKeyDictionary[HttpRequest, str] = WeakKeyDictionary()


def can_see_endpoint_urls(request: HttpRequest) -> bool:
    """Whole webhook URLs (which may hold the receiver's credentials) are for
    those who may see the endpoints; others see scheme, host and port."""
    return request.user.has_perm("jobs.view_webhookendpoint")


def body_without_endpoint_url(body: str) -> str:
    """A ``webhook.test`` body names its endpoint's URL: keep only its origin.
    Other bodies, and anything that does not parse, are returned as they are."""
    try:
        document = json.loads(body)
        endpoint = document["data"]["endpoint"]
        url = endpoint["url"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return body
    if not isinstance(url, str):
        return body
    endpoint["url"] = url_origin(url)
    return json.dumps(document, separators=(",", ":"))


def _endpoints(n: int) -> str:
    return f"{n} endpoint" if n == 1 else f"{n} endpoints"


class WebhookEndpointForm(forms.ModelForm):
    events = forms.MultipleChoiceField(
        choices=[(e, e) for e in SUBSCRIBABLE_EVENTS],
        widget=forms.CheckboxSelectMultiple,
        initial=["batch.finished"],
        help_text="What the endpoint is sent.",
    )

    class Meta:
        model = WebhookEndpoint
        fields = ("url", "events", "description")
        help_texts = {
            "url": "http:// or https://. Checked now (its addresses must not be "
            "link-local, metadata, loopback or private) and before every delivery.",
        }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.initial["events"] = self.instance.event_types()

    def clean_url(self) -> str:
        try:
            return check_url(self.cleaned_data["url"])
        except EndpointInvalid as invalid:
            raise forms.ValidationError(str(invalid)) from invalid

    def clean_events(self) -> str:
        try:
            return ",".join(parse_events(self.cleaned_data["events"]))
        except EndpointInvalid as invalid:
            raise forms.ValidationError(str(invalid)) from invalid

    def clean_description(self) -> str:
        text = self.cleaned_data["description"].strip()
        if any(not c.isprintable() for c in text):
            raise forms.ValidationError("Use printable characters.")
        return text


class DeliveryInline(ReadOnlyInline):
    model = WebhookDelivery
    fields = ("endpoint", "status", "attempts", "summary_column", "next_attempt_at")
    readonly_fields = fields
    verbose_name_plural = "deliveries"

    def has_view_permission(self, request: HttpRequest, obj=None) -> bool:
        # A delivery is part of its event: who may see the event sees them.
        return request.user.has_perm("jobs.view_webhookevent")

    @admin.display(description="state")
    def summary_column(self, delivery: WebhookDelivery) -> str:
        return delivery.summary()


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):
    """Endpoints: add (the secret is shown once), edit the URL and the
    subscription, disable, re-enable, rotate the secret, send a test event."""

    list_display = (
        "url",
        "events",
        "is_active",
        "disabled_reason",
        "created_at",
        "deliveries_column",
    )
    list_filter = ("is_active",)
    search_fields = ("url", "description")
    ordering = ("pk",)
    form = WebhookEndpointForm
    actions = ("disable_endpoints", "enable_endpoints", "rotate_secrets", "send_test")
    readonly_fields = (
        "is_active",
        "disabled_reason",
        "created_at",
        "previous_secret_expires_at",
        "deliveries_column",
    )

    def get_fields(self, request: HttpRequest, obj=None) -> tuple[str, ...]:
        editable = ("url", "events", "description")
        return editable if obj is None else editable + self.readonly_fields

    def get_readonly_fields(self, request: HttpRequest, obj=None) -> tuple[str, ...]:
        return () if obj is None else self.readonly_fields

    def has_rotate_webhook_secret_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.rotate_webhook_secret")

    def has_send_test_webhook_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.send_test_webhook")

    def save_model(self, request, obj: WebhookEndpoint, form, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        endpoint, secret = transitions.create_webhook_endpoint(
            obj.url, events=obj.event_types(), description=obj.description
        )
        obj.pk, obj.created_at = endpoint.pk, endpoint.created_at
        obj.secret_encrypted = endpoint.secret_encrypted
        obj._state.adding, obj._state.db = False, endpoint._state.db
        _new_secrets[request] = secret

    def response_add(
        self, request: HttpRequest, obj: WebhookEndpoint, post_url_continue=None
    ) -> HttpResponse:
        return self._secret_page(
            request,
            title="Webhook endpoint created",
            secrets=[(obj, _new_secrets.pop(request))],
        )

    @admin.display(description="deliveries")
    def deliveries_column(self, endpoint: WebhookEndpoint) -> str:
        return changelist_link(
            WebhookAttempt, "attempts", delivery__endpoint__id__exact=endpoint.pk
        )

    # Actions.

    @admin.action(description="Disable selected endpoints", permissions=["change"])
    def disable_endpoints(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._set_active(request, queryset, active=False)

    @admin.action(description="Re-enable selected endpoints", permissions=["change"])
    def enable_endpoints(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._set_active(request, queryset, active=True)

    def _set_active(
        self, request: HttpRequest, queryset: QuerySet, *, active: bool
    ) -> None:
        done = 0
        for endpoint in queryset.order_by("pk"):
            with transaction.atomic():
                if transitions.set_webhook_endpoint_active(
                    endpoint,
                    active,
                    reason=f"Disabled by {request.user} in the admin.",
                ):
                    log_changes(
                        request,
                        [endpoint],
                        "Re-enabled: waiting deliveries resume."
                        if active
                        else "Disabled: deliveries wait until it is re-enabled.",
                    )
                    done += 1
        verb = "Re-enabled" if active else "Disabled"
        self.message_user(request, f"{verb} {_endpoints(done)}.", messages.SUCCESS)

    @admin.action(
        description="Rotate the secrets of selected endpoints",
        permissions=["rotate_webhook_secret"],
    )
    def rotate_secrets(
        self, request: HttpRequest, queryset: QuerySet
    ) -> HttpResponse | None:
        endpoints = list(queryset.order_by("pk"))
        hours = settings.RECALL_WEBHOOK_ROTATION_HOURS
        if not is_confirmed(request):
            return render_confirmation(
                self,
                request,
                Confirmation(
                    title="Rotate webhook secrets",
                    summary="Give each selected endpoint a new signing secret.",
                    counts=[("Endpoints selected: new secrets", len(endpoints))],
                    effects=[
                        "The new secret is shown once, on the next page, and never "
                        "again: copy it into the receiver.",
                        f"For {hours} hours (RECALL_WEBHOOK_ROTATION_HOURS) every "
                        "delivery is signed with the old and the new secret, so the "
                        "receiver can switch without missing an event.",
                    ],
                    sample=[
                        link_to_id(WebhookEndpoint, e.pk, e.url)
                        for e in endpoints[:SAMPLE_SIZE]
                    ],
                    changing=len(endpoints),
                    button=f"Rotate the secrets of {_endpoints(len(endpoints))}",
                ),
            )
        now = transitions.now()
        secrets = []
        for endpoint in endpoints:
            with transaction.atomic():
                secret = transitions.rotate_webhook_secret(endpoint, now=now)
                log_changes(
                    request,
                    [endpoint],
                    f"Rotated the secret; the old one is signed with for {hours} h.",
                )
            secrets.append((endpoint, secret))
        return self._secret_page(
            request,
            title="Secrets rotated",
            secrets=secrets,
            rotated=now + timedelta(hours=hours) if hours else None,
        )

    @admin.action(
        description="Send a test event to selected endpoints",
        permissions=["send_test_webhook"],
    )
    def send_test(self, request: HttpRequest, queryset: QuerySet) -> None:
        endpoints = list(queryset.order_by("pk"))
        for endpoint in endpoints:
            with transaction.atomic():
                event = transitions.send_test_webhook(endpoint)
                log_changes(request, [endpoint], f"Sent test event {event.webhook_id}.")
        self.message_user(
            request,
            f"Sent a test event to {_endpoints(len(endpoints))}: see its delivery "
            f"under Webhook events in a few seconds.",
            messages.SUCCESS,
        )

    def _secret_page(
        self, request: HttpRequest, *, title: str, secrets, rotated=None
    ) -> HttpResponse:
        """Show new secrets, once: this response is the only place they appear."""
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "subtitle": None,
            "opts": self.opts,
            "secrets": secrets,
            "rotated": rotated,
        }
        request.current_app = self.admin_site.name
        response = TemplateResponse(
            request, "admin/jobs/webhookendpoint/secret.html", context
        )
        add_never_cache_headers(response)
        return response


@admin.register(WebhookEvent)
class WebhookEventAdmin(BigTableAdmin):
    """The outbox, read-only; redeliver selected events now."""

    list_display = (
        "id",
        "created_at",
        "type",
        "batch_column",
        "generation",
        "webhook_id",
    )
    list_filter = ("type", BatchFilter)
    search_fields = ("webhook_id",)
    search_help_text = "A batch id, or a webhook-id (msg_…)."
    fields = (
        "webhook_id",
        "type",
        "created_at",
        "batch_column",
        "generation",
        "item",
        "body",
    )
    readonly_fields = fields
    inlines = (DeliveryInline,)
    actions = ("redeliver",)

    def get_fields(self, request: HttpRequest, obj=None) -> tuple[str, ...]:
        if can_see_endpoint_urls(request):
            return self.fields
        return tuple("body_column" if f == "body" else f for f in self.fields)

    def get_readonly_fields(self, request: HttpRequest, obj=None) -> tuple[str, ...]:
        return self.get_fields(request, obj)

    @admin.display(description="body")
    def body_column(self, event: WebhookEvent) -> str:
        """The body, with the URL of a test event's endpoint cut to its origin
        (for those who may not see endpoints)."""
        return body_without_endpoint_url(event.body)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        number = as_id(term)
        if number is not None:
            return queryset.filter(batch_id=min(number, 2**63 - 1)), False
        return queryset.filter(webhook_id=term), False

    def has_redeliver_webhookevent_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.redeliver_webhookevent")

    @admin.display(description="batch")
    def batch_column(self, event: WebhookEvent) -> str:
        return link_to_id(Batch, event.batch_id, f"batch {event.batch_id}")

    @admin.action(
        description="Redeliver selected events now",
        permissions=["redeliver_webhookevent"],
    )
    def redeliver(self, request: HttpRequest, queryset: QuerySet) -> None:
        ids = list(queryset.values_list("pk", flat=True)[:1000])
        with transaction.atomic():
            deliveries = transitions.redeliver_webhooks(ids)
            log_changes(
                request,
                WebhookEvent.objects.filter(pk__in=ids),
                "Redelivered: every delivery made due now.",
            )
        self.message_user(
            request,
            f"Redelivering {len(ids)} event(s): {deliveries} delivery(ies) due now, "
            f"with their original webhook-id.",
            messages.SUCCESS,
        )


@admin.register(WebhookAttempt)
class WebhookAttemptAdmin(BigTableAdmin):
    """Every delivery attempt: when, the answer, how long, what went wrong."""

    list_display = (
        "id",
        "started_at",
        "event_column",
        "endpoint_column",
        "number",
        "status_code",
        "duration_ms",
        "error_column",
        "excerpt_column",
    )
    list_filter = ("status_code",)
    list_select_related = ("delivery__event", "delivery__endpoint")
    fields = (
        "started_at",
        "finished_at",
        "event_column",
        "endpoint_column",
        "number",
        "status_code",
        "duration_ms",
        "error",
        "response_excerpt",
    )
    readonly_fields = fields
    search_fields = ("delivery__event__webhook_id",)
    search_help_text = "A webhook-id (msg_…)."

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(delivery__event__webhook_id=term), False

    @admin.display(description="event")
    def event_column(self, attempt: WebhookAttempt) -> str:
        event = attempt.delivery.event
        return link_to_id(WebhookEvent, event.pk, f"{event.type} {event.webhook_id}")

    @admin.display(description="endpoint")
    def endpoint_column(self, attempt: WebhookAttempt) -> str:
        endpoint = attempt.delivery.endpoint
        return link_to_id(WebhookEndpoint, endpoint.pk, str(endpoint))

    @admin.display(description="error")
    def error_column(self, attempt: WebhookAttempt) -> str:
        return Truncator(attempt.error).chars(120)

    @admin.display(description="response")
    def excerpt_column(self, attempt: WebhookAttempt) -> str:
        return Truncator(attempt.response_excerpt).chars(80)
