"""Helpers the tests import: factories for rows, the webhook receiver, clients
for the APIs and pages, the real server on the test database. Nothing here is a
test, and no test imports from a ``conftest.py`` or another ``test_*.py``."""
