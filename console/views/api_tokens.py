"""The "API tokens" page: a logged-in user creates (shown once), lists and
revokes their own personal API tokens. A token carries its user's permissions,
so anyone who may log in may have one; what it can do is what they can do."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from jobs import transitions
from operator_api import tokens
from operator_api.models import MAX_EXPIRY_DAYS, MAX_LABEL_CHARS, ApiToken


class NewTokenForm(forms.Form):
    label = forms.CharField(
        max_length=MAX_LABEL_CHARS,
        required=False,
        strip=True,
        help_text="What uses it, e.g. 'nightly upload'.",
    )
    expires_in_days = forms.IntegerField(
        label="Expires after (days)",
        required=False,
        min_value=1,
        max_value=MAX_EXPIRY_DAYS,
        help_text="Empty: until you revoke it.",
    )

    def clean_label(self) -> str:
        label = self.cleaned_data["label"]
        if any(ord(c) < 32 for c in label):
            raise forms.ValidationError("The label must be printable characters.")
        return label


def _user_id(request: HttpRequest) -> int:
    """The logged-in user's id (``login_required`` has made sure there is one)."""
    pk = request.user.pk
    if pk is None:
        raise Http404("Not logged in.")
    return pk


@login_required
@require_http_methods(["GET", "POST"])
def token_list(request: HttpRequest) -> HttpResponse:
    form = NewTokenForm(request.POST or None)
    new_token = None
    status = 200
    if request.method == "POST":
        if form.is_valid():
            _, new_token = tokens.issue_token(
                request.user,
                label=form.cleaned_data["label"],
                now=transitions.now(),
                expires_in_days=form.cleaned_data["expires_in_days"],
            )
            form = NewTokenForm()
        else:
            status = 400
    response = render(
        request,
        "operator_api/tokens.html",
        {
            "form": form,
            "new_token": new_token,
            "tokens": ApiToken.objects.filter(user_id=_user_id(request)),
            "now": transitions.now(),
            "nav": "api-tokens",
        },
        status=status,
    )
    # The page may hold a token in clear: never keep it in a cache.
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def token_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    mine = ApiToken.objects.filter(pk=pk, user_id=_user_id(request))
    token = mine.first()
    if token is None:
        raise Http404("No such token of yours.")
    if tokens.revoke(mine, now=transitions.now()):
        messages.success(request, f"Revoked “{token.label or token.token_prefix}”.")
    else:
        messages.info(request, "That token was already revoked.")
    return redirect("api-tokens")
