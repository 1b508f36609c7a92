"""The Viewers and Operators groups with their permissions (see batches/roles.py)."""

from django.db import migrations

from batches.roles import GROUPS, ensure_groups


def create_groups(apps, schema_editor):
    ensure_groups(apps)


def remove_groups(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=GROUPS).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0002_throughput_and_permissions"),
        ("jobs", "0002_sweep_schedule"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(create_groups, remove_groups)]
