"""The admin's API tokens: every user's, listed, and revoked by an action.

Tokens are created by their users (the API tokens page) or with
``manage.py create_api_token``, never here, and never edited: the hash and
prefix are what they were issued as, and revoking is one audited action.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest

from console.admin.support import log_changes
from jobs import transitions
from operator_api import tokens
from operator_api.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = (
        "label",
        "user",
        "token_prefix",
        "created_at",
        "last_used",
        "expires_at",
        "revoked_at",
    )
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    search_fields = ("label", "user__username", "token_prefix")
    list_select_related = ("user",)
    ordering = ("-created_at", "-pk")
    readonly_fields = list_display
    fields = list_display
    actions = ("revoke_tokens",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    @admin.action(description="Revoke the selected API tokens", permissions=["change"])
    def revoke_tokens(self, request: HttpRequest, queryset: QuerySet[ApiToken]):
        with transaction.atomic():
            live = list(queryset.filter(revoked_at__isnull=True))
            revoked = tokens.revoke(
                ApiToken.objects.filter(pk__in=[t.pk for t in live]),
                now=transitions.now(),
            )
            log_changes(request, live, "Revoked.")
        self.message_user(request, f"Revoked {revoked} API token(s).", messages.SUCCESS)
