from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path

from api import openapi
from api import operator_views as operator_api
from api import worker_views as worker_api
from console.views import api_tokens as token_pages
from console.views import overview, workers
from recall_site.views import favicon

urlpatterns = [
    path("api/v1/claim", worker_api.claim, name="api-claim"),
    path(
        "api/v1/jobs/<int:job_id>/heartbeat", worker_api.heartbeat, name="api-heartbeat"
    ),
    path("api/v1/heartbeat", worker_api.heartbeat_many, name="api-heartbeat-many"),
    path("api/v1/complete", worker_api.complete_many, name="api-complete-many"),
    path("api/v1/jobs/<int:job_id>/complete", worker_api.complete, name="api-complete"),
    path("api/v1/jobs/<int:job_id>/fail", worker_api.fail, name="api-fail"),
    path("api/v1/jobs/<int:job_id>/release", worker_api.release, name="api-release"),
    path("api/v1/openapi.json", openapi.openapi, name="api-openapi"),
    path("api/v1/batches", operator_api.batches, name="operator-api-batches"),
    path(
        "api/v1/batches/<int:batch_id>",
        operator_api.batch_detail,
        name="operator-api-batch",
    ),
    path(
        "api/v1/batches/<int:batch_id>/items",
        operator_api.batch_items,
        name="operator-api-items",
    ),
    path(
        "api/v1/batches/<int:batch_id>/export.<str:fmt>",
        operator_api.batch_export,
        name="operator-api-export",
    ),
    path("api/v1/batches/<int:batch_id>/pause", operator_api.batch_pause),
    path("api/v1/batches/<int:batch_id>/resume", operator_api.batch_resume),
    path("api/v1/batches/<int:batch_id>/cancel", operator_api.batch_cancel),
    path("api/v1/batches/<int:batch_id>/retry", operator_api.batch_retry),
    path(
        "api/v1/batches/<int:batch_id>/rerun",
        operator_api.batch_rerun,
        name="operator-api-rerun",
    ),
    re_path(r"^api/", worker_api.not_found),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("workers/", workers.worker_list, name="worker-list"),
    path("workers/live", workers.worker_list_live, name="worker-list-live"),
    path("api-tokens/", token_pages.token_list, name="api-tokens"),
    path(
        "api-tokens/<int:pk>/revoke", token_pages.token_revoke, name="api-token-revoke"
    ),
    path("overview/", overview.overview, name="overview"),
    path("overview/live", overview.overview_live, name="overview-live"),
    path("favicon.ico", favicon, name="favicon"),
    path("", include("console.urls")),
]

handler500 = "recall_site.views.server_error"
