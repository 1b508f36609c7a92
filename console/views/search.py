"""The search page: items of every batch whose transcripts hold some words.

The batches a user may view are every batch (``batches.view_batch``, as on the
batch pages). Hits come newest item first, a page at a time by keyset
(``older``/``newer`` item ids), never counted or ranked: a common word matches
thousands of transcripts and no page reads them all (``jobs.search``).
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render
from django.views.decorators.http import require_GET

from batches.models import BatchItem
from batches.numbers import MAX_ID, whole_number
from batches.roles import viewer_required
from console.forms import SearchForm
from jobs.search import (
    Search,
    hits,
    in_windows,
    item_ids,
    matches_substrings,
    through_the_index,
)

HITS_PER_PAGE = 25


def _cursor(request: HttpRequest, name: str) -> int | None:
    number = whole_number(request.GET.get(name, ""))
    return number if number is not None and number <= MAX_ID else None


def _page(request: HttpRequest, search: Search) -> dict:
    """One page of hits, newest first, and the cursors around it: read a
    window of item ids at a time (``jobs.search.in_windows``)."""
    items = BatchItem.objects.select_related("batch", "job").only(
        "id", "source", "status", "batch__id", "batch__name", "job__result"
    )
    older, newer = _cursor(request, "older"), _cursor(request, "newer")
    ids = item_ids(BatchItem.objects.all())
    low, high = ids if ids is not None else (1, 0)
    with through_the_index():
        if newer is not None:
            rows = in_windows(
                items, search, HITS_PER_PAGE + 1, max(low, newer + 1), high
            )
            more_newer, rows = len(rows) > HITS_PER_PAGE, rows[:HITS_PER_PAGE]
            rows.reverse()
            more_older = bool(rows)  # the page came back from older ones
        else:
            if older is not None:
                high = min(high, older - 1)
            rows = in_windows(
                items, search, HITS_PER_PAGE + 1, low, high, descending=True
            )
            more_older, rows = len(rows) > HITS_PER_PAGE, rows[:HITS_PER_PAGE]
            more_newer = older is not None and bool(rows)
    return {
        "hits": hits(rows, search),
        "older": rows[-1].pk if rows and more_older else None,
        "newer": rows[0].pk if rows and more_newer else None,
        "first_page": older is None and newer is None,
    }


@require_GET
@viewer_required
def search(request: HttpRequest) -> HttpResponse:
    context: dict = {
        "nav": "search",
        "form": SearchForm(),
        "search": None,
        "substrings": matches_substrings(),
    }
    status = 200
    if "q" in request.GET:
        form = SearchForm(request.GET)
        context["form"] = form
        if form.is_valid():
            context["search"] = form.cleaned_data["q"]
            context.update(_page(request, context["search"]))
            # The search alone, for the pager's links.
            query = QueryDict(mutable=True)
            query["q"] = form.data["q"]
            context["query"] = query.urlencode()
        else:
            status = 400
    return render(request, "search/results.html", context, status=status)
