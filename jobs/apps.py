from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs and leases"

    def ready(self) -> None:
        from django_q.signals import post_spawn

        from .tasks import cluster_worker_started

        # A cluster starting resumes the webhook deliveries a killed one left.
        post_spawn.connect(cluster_worker_started, dispatch_uid="recall-dispatch")
