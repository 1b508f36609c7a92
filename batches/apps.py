from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "batches"
    verbose_name = "Batches"

    def ready(self) -> None:
        # Background intakes' models live in a module of their own.
        from . import intake_records  # noqa: F401
