"""Move the stored django-q2 schedule that forgets expired idempotency keys to
the task function's new home, ``engine.tasks`` (issue 25). Tasks already
queued under the old path still run: ``engine/apps.py`` aliases it."""

from django.db import migrations

OLD = "operator_api.tasks.forget_expired_keys"
NEW = "engine.tasks.forget_expired_keys"


def forwards(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.filter(func=OLD).update(func=NEW)


def backwards(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.filter(func=NEW).update(func=OLD)


class Migration(migrations.Migration):
    dependencies = [
        ("operator_api", "0003_api_token_expiry"),
        ("django_q", "0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
