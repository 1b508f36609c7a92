"""The Django admin: batches and items, jobs, the lease ledger, workers, the
event log, webhooks and API tokens (models of the batches, jobs and
operator_api apps, registered from here).

Admins inspect and intervene here, and the admin never becomes a way to break
the invariants the transitions keep:

* Status, lease and attempt fields are read-only everywhere. Jobs, ledger rows
  and events cannot be added, edited or deleted through the admin at all.
* Every intervention is an action with a confirmation page, gated by its own
  permission, that calls a transition (``jobs.transitions``: force reclaim,
  retry failed, cancel queued, or the sweep) over the selection's ids in
  chunks, so "all N matching" never holds locks for long.
* Every action is audited twice, in the transaction that makes the change: an
  ``Event`` per job (written by the transition) and a Django admin ``LogEntry``
  per row (written through the transitions' ``audit`` hook).

List pages stay cheap on tables of millions of rows: no COUNT(*) of a whole big
table (``EstimatedCountPaginator``), related rows fetched in the page's query,
filters that run no query or a tiny one, sorting only by id, search by id on
the primary key index. One module per model (``webhook`` holds the webhook
endpoints, events and attempts); ``job_actions`` says what each bulk job
action does; ``support`` holds the building blocks the modules share.
"""

from console.admin import (
    api_token,
    batch,
    event,
    job,
    lease,
    log_entry,
    webhook,
    worker,
)

__all__ = [
    "api_token",
    "batch",
    "event",
    "job",
    "lease",
    "log_entry",
    "webhook",
    "worker",
]
