from django.contrib import admin
from django.urls import path, re_path
from django.views.generic import RedirectView

from jobs import api

urlpatterns = [
    path("api/v1/claim", api.claim, name="api-claim"),
    path("api/v1/jobs/<int:job_id>/heartbeat", api.heartbeat, name="api-heartbeat"),
    path("api/v1/jobs/<int:job_id>/complete", api.complete, name="api-complete"),
    path("api/v1/jobs/<int:job_id>/fail", api.fail, name="api-fail"),
    path("api/v1/jobs/<int:job_id>/release", api.release, name="api-release"),
    re_path(r"^api/", api.not_found),
    path("admin/", admin.site.urls),
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
]

handler500 = "recall_site.views.server_error"
