"""Webhooks on the wire: where they may go, how they are signed and sent.

What to send is decided by the transitions, in the transaction that finishes a
batch or fails an item (``jobs.transitions.outbox`` writes the event and one
delivery per subscribed endpoint; ``jobs.transitions.webhook_writes`` changes
endpoints and records attempts). This package does the rest:

* ``destinations``: the URL and address rules (no SSRF);
* ``endpoints``: creating an endpoint, the checks every door applies first;
* ``jobs/webhook_keys.py`` (below, used by the transitions too): secrets,
  kept encrypted, and their signing keys;
* ``signing``: Standard Webhooks signatures;
* ``delivery``: attempts over HTTP, and the dispatcher that keeps time.
"""
