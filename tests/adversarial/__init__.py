"""Hostile clients against the real server (gunicorn.conf.py): slow clients,
connection floods, parked claims with large bodies, planted files."""
