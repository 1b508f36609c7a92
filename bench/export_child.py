"""Export a batch through the view, as a browser would, and print the row count.

Run as its own process (``python -m bench.export_child BATCH FORMAT``) so that
its peak RSS is the export's alone.
"""

from __future__ import annotations

import sys


def main() -> None:
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.test import Client

    batch, fmt = sys.argv[1], sys.argv[2]
    User = get_user_model()
    user = User.objects.filter(username="bench-export").first()
    if user is None:
        user = User.objects.create_user("bench-export", is_superuser=True)
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    response = client.get(f"/batches/{batch}/export.{fmt}")
    if response.status_code != 200 or not response.streaming:
        raise SystemExit(f"export answered {response.status_code}, not a stream")
    lines = 0
    for chunk in response.streaming_content:
        lines += chunk.count(b"\n")
    print(lines - 1)  # without the header


if __name__ == "__main__":
    main()
