from django.urls import path

from . import views

urlpatterns = [
    path("", views.overview, name="overview"),
    path("live", views.overview_live, name="overview-live"),
]
