"""The operator pages' forms: a new batch, its share of the workers and the
worker labels it requires, item filters."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from django import forms
from django.conf import settings
from django.template.defaultfilters import filesizeformat

from batches.flags import FLAGS
from batches.labels import MAX_LABELS, LabelError, format_pairs, parse_pairs
from batches.models import MAX_IN_FLIGHT, MAX_WEIGHT, ItemStatus
from engine.manifests import MAX_NAME_CHARS
from jobs.search import MAX_SEARCH_CHARS, BadSearch, Search, parse_search

# Pairs are written one per line or separated by commas (a value never holds one).
PAIR_SEPARATOR = re.compile(r"[,\n]")


class RequiresField(forms.CharField):
    """Worker labels a batch requires, typed as ``key=value`` pairs, one per
    line or comma-separated; cleaned to a dict by ``batches.labels`` (its
    message is the form error). Empty: any worker."""

    widget = forms.Textarea(attrs={"rows": 2, "spellcheck": "false"})

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("required", False)
        kwargs.setdefault("label", "Requires")
        kwargs.setdefault(
            "help_text",
            f"Worker labels a worker must offer to take this batch's jobs, as "
            f"key=value (e.g. gpu=a100, model=large-v3), one per line or "
            f"comma-separated, at most {MAX_LABELS}. Empty: any worker.",
        )
        super().__init__(strip=True, **kwargs)

    def prepare_value(self, value: Any) -> Any:
        return format_pairs(value) if isinstance(value, Mapping) else value

    def to_python(self, value: Any) -> dict[str, str]:  # type: ignore[override]
        if isinstance(value, Mapping):
            return dict(value)
        text = super().to_python(value) or ""
        if "\x00" in text:
            raise forms.ValidationError("Requires must not contain NUL characters.")
        try:
            return parse_pairs(PAIR_SEPARATOR.split(text), what="requires")
        except LabelError as error:
            raise forms.ValidationError(str(error)) from None

    def has_changed(self, initial: Any, data: Any) -> bool:
        try:
            return self.to_python(data) != (initial or {})
        except forms.ValidationError:
            return True


class ShareFields(forms.Form):
    """How a batch shares the workers: priority, weight, max in flight."""

    priority = forms.IntegerField(
        initial=0,
        min_value=-32768,
        max_value=32767,
        help_text="Higher runs first, strictly.",
    )
    weight = forms.IntegerField(
        initial=1,
        required=False,
        min_value=1,
        max_value=MAX_WEIGHT,
        help_text=f"Its share of the workers among open batches of its priority "
        f"(1 to {MAX_WEIGHT}; empty: 1).",
    )
    max_in_flight = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=MAX_IN_FLIGHT,
        label="Max in flight",
        help_text="At most this many items in flight at once (empty: no cap).",
    )

    def clean_weight(self) -> int:
        weight = self.cleaned_data.get("weight")
        return 1 if weight is None else weight


class ShareForm(ShareFields):
    """The batch page's form to change a batch's share."""


class RequiresForm(forms.Form):
    """The batch page's form to change the worker labels a batch requires."""

    requires = RequiresField()


class RerunForm(forms.Form):
    """The batch page's re-run: the items ticked in the table (``item``, read
    by the view) or every done item with a flag, and the worker labels the new
    run requires on top of the batch's."""

    flag = forms.ChoiceField(
        choices=[
            ("", "the items ticked below"),
            *((f, f"every item flagged {f}") for f in FLAGS),
        ],
        required=False,
        label="Re-run",
    )
    requires = RequiresField(
        label="Requiring",
        help_text=(
            "Worker labels the new run needs on top of the batch's, as key=value "
            "(e.g. model=large-v3). Empty: the batch's requirement alone."
        ),
    )


class NewBatchForm(ShareFields):
    field_order = [
        "name",
        "priority",
        "weight",
        "max_in_flight",
        "requires",
        "manifest",
        "sources",
    ]

    name = forms.CharField(max_length=MAX_NAME_CHARS, strip=True)
    requires = RequiresField()
    manifest = forms.FileField(
        required=False,
        help_text=(
            "A text file with one source per line, or a CSV file with a 'source' "
            "column (optional 'duration_seconds'; other columns become params)."
        ),
    )
    sources = forms.CharField(
        required=False,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 8, "spellcheck": "false"}),
        help_text="Or paste the manifest here.",
    )

    def clean_manifest(self):
        manifest = self.cleaned_data.get("manifest")
        limit = settings.RECALL_MAX_MANIFEST_BYTES
        if manifest is not None and manifest.size > limit:
            raise forms.ValidationError(
                f"The file is {filesizeformat(manifest.size)}; the limit is "
                f"{filesizeformat(limit)}. Split it into several batches, or use the "
                f"create_batch command."
            )
        return manifest

    def clean(self):
        cleaned = super().clean() or {}
        has_file = bool(cleaned.get("manifest"))
        has_text = bool((cleaned.get("sources") or "").strip())
        if has_file and has_text:
            raise forms.ValidationError("Upload a file or paste sources, not both.")
        if not has_file and not has_text and not self.errors:
            raise forms.ValidationError("Upload a manifest file or paste sources.")
        return cleaned


class ItemFilterForm(forms.Form):
    """The items table's filter: a state, a quality flag and a search (the
    source's text, or words of the transcript: ``jobs.search``)."""

    state = forms.ChoiceField(required=False)
    flag = forms.ChoiceField(
        required=False,
        choices=[("", "any or none"), *((f, f.replace("_", " ")) for f in FLAGS)],
    )
    q = forms.CharField(required=False, max_length=MAX_SEARCH_CHARS, strip=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        state = self.fields["state"]
        if isinstance(state, forms.ChoiceField):
            state.choices = [("", "all states"), *ItemStatus.choices]

    def clean_q(self):
        q = self.cleaned_data["q"]
        if "\x00" in q:
            raise forms.ValidationError("The search must not contain NUL characters.")
        return q


class SearchForm(forms.Form):
    """The search page's query: words of the transcripts (``jobs.search``)."""

    q = forms.CharField(
        label="Words",
        required=False,
        max_length=MAX_SEARCH_CHARS,
        strip=False,
        widget=forms.TextInput(attrs={"type": "search", "autofocus": True}),
    )

    def clean_q(self) -> Search:
        try:
            return parse_search(self.cleaned_data["q"])
        except BadSearch as bad:
            raise forms.ValidationError(str(bad)) from None
