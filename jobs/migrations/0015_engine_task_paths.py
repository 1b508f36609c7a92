"""Move the stored django-q2 schedules of the sweep and the webhook dispatcher
to the task functions' new home, ``engine.tasks`` (issue 25). Tasks already
queued under the old paths still run: ``engine/apps.py`` aliases them."""

from django.db import migrations

MOVED = {
    "jobs.tasks.sweep": "engine.tasks.sweep",
    "jobs.tasks.dispatch_webhooks": "engine.tasks.dispatch_webhooks",
}


def forwards(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    for old, new in MOVED.items():
        Schedule.objects.filter(func=old).update(func=new)


def backwards(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    for old, new in MOVED.items():
        Schedule.objects.filter(func=new).update(func=old)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0014_claim_turn_refuses_disabled"),
        ("django_q", "0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
