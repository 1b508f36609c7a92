from django.apps import AppConfig
from django.db.backends.signals import connection_created


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs and leases"

    def ready(self) -> None:
        from jobs.transitions.backends.postgres import plan_once

        connection_created.connect(plan_once, dispatch_uid="jobs.plan_once")
