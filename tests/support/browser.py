"""A worker talking to the live server over real HTTP, for the browser tests."""

from __future__ import annotations

import json
import urllib.request

from jobs import transitions


class Api:
    """A worker talking to the live server over real HTTP."""

    def __init__(self, base: str, name: str = "browser-test-worker"):
        _, self.token = transitions.create_worker(name)
        self.base = base

    def post(self, path: str, body: dict) -> tuple[int, dict | None]:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None

    def claim(self) -> tuple[int, dict | None]:
        return self.post("/api/v1/claim", {})

    def complete(self, job: dict) -> None:
        status, _ = self.post(
            f"/api/v1/jobs/{job['id']}/complete",
            {
                "lease_token": job["lease_token"],
                "result": {"text": "hello from the browser test"},
            },
        )
        assert status == 200
