import batches.json_limits
from django.db import migrations, models


class Migration(migrations.Migration):
    """JSON columns read through batches.json_limits.StoredJSONDecoder, which
    bounds nesting without recursion. The decoder lives in Python only: the
    tables do not change (on SQLite an AlterField would copy every row)."""

    dependencies = [
        ("batches", "0006_batch_finishes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="batchitem",
                    name="params",
                    field=models.JSONField(
                        blank=True,
                        decoder=batches.json_limits.StoredJSONDecoder,
                        default=dict,
                    ),
                ),
                migrations.AlterField(
                    model_name="intake",
                    name="errors",
                    field=models.JSONField(
                        blank=True,
                        decoder=batches.json_limits.StoredJSONDecoder,
                        default=list,
                    ),
                ),
            ],
        ),
    ]
