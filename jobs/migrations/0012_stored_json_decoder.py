import batches.json_limits
from django.db import migrations, models


class Migration(migrations.Migration):
    """JSON columns read through batches.json_limits.StoredJSONDecoder, which
    bounds nesting without recursion. The decoder lives in Python only: the
    tables do not change (on SQLite an AlterField would copy every row)."""

    dependencies = [
        ("jobs", "0011_webhook_urls_out_of_the_admin_log"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="job",
                    name="result",
                    field=models.JSONField(
                        blank=True,
                        decoder=batches.json_limits.StoredJSONDecoder,
                        null=True,
                    ),
                ),
                migrations.AlterField(
                    model_name="sweepstate",
                    name="last_report",
                    field=models.JSONField(
                        blank=True,
                        decoder=batches.json_limits.StoredJSONDecoder,
                        default=dict,
                    ),
                ),
            ],
        ),
    ]
