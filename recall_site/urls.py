from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path

from jobs import api, overview, views
from operator_api import openapi
from operator_api import pages as token_pages
from operator_api import views as operator_api
from recall_site.views import favicon

urlpatterns = [
    path("api/v1/claim", api.claim, name="api-claim"),
    path("api/v1/jobs/<int:job_id>/heartbeat", api.heartbeat, name="api-heartbeat"),
    path("api/v1/jobs/<int:job_id>/complete", api.complete, name="api-complete"),
    path("api/v1/jobs/<int:job_id>/fail", api.fail, name="api-fail"),
    path("api/v1/jobs/<int:job_id>/release", api.release, name="api-release"),
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
    re_path(r"^api/", api.not_found),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("workers/", views.worker_list, name="worker-list"),
    path("workers/live", views.worker_list_live, name="worker-list-live"),
    path("api-tokens/", token_pages.token_list, name="api-tokens"),
    path(
        "api-tokens/<int:pk>/revoke", token_pages.token_revoke, name="api-token-revoke"
    ),
    path("overview/", overview.overview, name="overview"),
    path("overview/live", overview.overview_live, name="overview-live"),
    path("favicon.ico", favicon, name="favicon"),
    path("", include("batches.urls")),
]

handler500 = "recall_site.views.server_error"
