"""The admin log named webhook endpoints by their whole URL, which may hold the
receiver's credentials, and anyone with ``admin.view_logentry`` could read it.
Endpoints are now named by id and origin (``WebhookEndpoint.__str__``); this
rewrites the names already logged the same way. Reversing it changes nothing:
the whole URLs are not kept anywhere to restore them from."""

from __future__ import annotations

from urllib.parse import urlsplit

from django.db import migrations


def _origin(url: str) -> str:
    # A copy of jobs.models.url_origin as it is today: migrations must not
    # follow later changes of the model module.
    try:
        parts = urlsplit(url)
        scheme, host, port = parts.scheme, parts.hostname, parts.port
    except ValueError:
        scheme, host, port = "", None, None
    if not host or scheme not in ("http", "https"):
        return "(a URL that cannot be shown)"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}" + (f":{port}" if port else "")


def forget_whole_urls(apps, schema_editor) -> None:
    ContentType = apps.get_model("contenttypes", "ContentType")
    LogEntry = apps.get_model("admin", "LogEntry")
    endpoint_type = ContentType.objects.filter(
        app_label="jobs", model="webhookendpoint"
    ).first()
    if endpoint_type is None:
        return
    entries = LogEntry.objects.filter(content_type=endpoint_type).exclude(
        object_repr__startswith="endpoint "
    )
    for entry in entries.iterator():
        name = f"endpoint {entry.object_id}: {_origin(entry.object_repr)}"
        entry.object_repr = name[:200]
        entry.save(update_fields=["object_repr"])


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0010_webhook_event_item_index"),
        ("admin", "0003_logentry_add_action_flag_choices"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(forget_whole_urls, migrations.RunPython.noop)]
