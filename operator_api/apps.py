from django.apps import AppConfig


class OperatorApiConfig(AppConfig):
    name = "operator_api"
    verbose_name = "Operator API"
