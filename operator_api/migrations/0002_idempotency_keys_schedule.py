"""Create the django-q2 schedule that deletes expired idempotency keys every
hour (idempotent)."""

from django.db import migrations

SCHEDULE_NAME = "recall-idempotency-keys"


def create_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.update_or_create(
        name=SCHEDULE_NAME,
        defaults={
            "func": "operator_api.tasks.forget_expired_keys",
            "schedule_type": "H",  # Schedule.HOURLY
            "repeats": -1,  # forever
        },
    )


def remove_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.filter(name=SCHEDULE_NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("operator_api", "0001_initial"),
        ("django_q", "0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more"),
    ]

    operations = [migrations.RunPython(create_schedule, remove_schedule)]
