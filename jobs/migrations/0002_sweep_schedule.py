"""Create the django-q2 schedule that runs the sweep every minute (idempotent)."""

from django.db import migrations

SCHEDULE_NAME = "recall-sweep"


def create_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.update_or_create(
        name=SCHEDULE_NAME,
        defaults={
            "func": "jobs.tasks.sweep",
            "schedule_type": "I",  # Schedule.MINUTES
            "minutes": 1,
            "repeats": -1,  # forever
        },
    )


def remove_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.filter(name=SCHEDULE_NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0001_initial"),
        ("django_q", "0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more"),
    ]

    operations = [migrations.RunPython(create_schedule, remove_schedule)]
