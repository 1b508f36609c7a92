from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path

from jobs import api, openapi, overview, views

urlpatterns = [
    path("api/v1/claim", api.claim, name="api-claim"),
    path("api/v1/jobs/<int:job_id>/heartbeat", api.heartbeat, name="api-heartbeat"),
    path("api/v1/jobs/<int:job_id>/complete", api.complete, name="api-complete"),
    path("api/v1/jobs/<int:job_id>/fail", api.fail, name="api-fail"),
    path("api/v1/jobs/<int:job_id>/release", api.release, name="api-release"),
    path("api/v1/openapi.json", openapi.openapi, name="api-openapi"),
    re_path(r"^api/", api.not_found),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("workers/", views.worker_list, name="worker-list"),
    path("overview/", overview.overview, name="overview"),
    path("overview/live", overview.overview_live, name="overview-live"),
    path("", include("batches.urls")),
]

handler500 = "recall_site.views.server_error"
