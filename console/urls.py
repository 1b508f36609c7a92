from django.urls import path

from console.views import batches as views
from console.views import search

urlpatterns = [
    path("", views.batch_list, name="batch-list"),
    path("batches/live", views.batch_list_live, name="batch-list-live"),
    path("batches/new/", views.batch_new, name="batch-new"),
    path("intakes/<int:pk>/", views.intake_detail, name="intake-detail"),
    path("batches/<int:pk>/", views.batch_detail, name="batch-detail"),
    path("batches/<int:pk>/live", views.batch_live, name="batch-live"),
    path(
        "batches/<int:pk>/items/live", views.batch_items_live, name="batch-items-live"
    ),
    path("batches/<int:pk>/progress.json", views.batch_progress, name="batch-progress"),
    path("batches/<int:pk>/pause", views.batch_pause, name="batch-pause"),
    path("batches/<int:pk>/resume", views.batch_resume, name="batch-resume"),
    path("batches/<int:pk>/cancel", views.batch_cancel, name="batch-cancel"),
    path("batches/<int:pk>/retry", views.batch_retry, name="batch-retry"),
    path("batches/<int:pk>/rerun", views.batch_rerun, name="batch-rerun"),
    path("batches/<int:pk>/share", views.batch_share, name="batch-share"),
    path("batches/<int:pk>/requires", views.batch_requires, name="batch-requires"),
    path("batches/<int:pk>/export.<str:fmt>", views.batch_export, name="batch-export"),
    path("items/<int:pk>/", views.item_detail, name="item-detail"),
    path("search/", search.search, name="search"),
]
