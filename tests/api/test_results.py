"""Worker API: a result's segment times are bounded, and no number in a body may
overflow to infinity. Bad input is a 400, never a 500, and nothing is stored."""

import pytest

from jobs.models import Job, JobStatus

pytestmark = pytest.mark.django_db

SEGMENT_ERROR = (
    "result.segments[{n}] must be an object with finite numbers 0 <= 'start' <= "
    "'end' <= 10000000 (seconds) and a string 'text'."
)


def _claimed(api, batch) -> dict:
    return api.claim().json()["job"]


@pytest.mark.parametrize(
    ("raw_segments", "n"),
    [
        ('[{"start": 1e306, "end": 1e306, "text": "x"}]', 0),
        ('[{"start": 0, "end": 1e400, "text": "x"}]', None),  # infinity
        (
            '[{"start": 0, "end": 1, "text": "a"}, {"start": 5, "end": 10000000.5, "text": "b"}]',
            1,
        ),
        ('[{"start": -0.5, "end": 1, "text": "x"}]', 0),
        ('[{"start": 2, "end": 1, "text": "x"}]', 0),
        ('[{"start": 0, "end": 99999999999, "text": "x"}]', 0),
    ],
)
def test_segment_times_out_of_bounds_are_400(api, batch, raw_segments, n):
    job = _claimed(api, batch)
    raw = (
        f'{{"lease_token": "{job["lease_token"]}", '
        f'"result": {{"text": "x", "segments": {raw_segments}}}}}'
    ).encode()

    response = api.post(f"/api/v1/jobs/{job['id']}/complete", raw=raw)

    assert response.status_code == 400
    detail = (
        "Numbers must be finite (this one overflows)."
        if n is None
        else SEGMENT_ERROR.format(n=n)
    )
    assert response.json() == {"error": "bad_request", "detail": detail}
    assert Job.objects.get(pk=job["id"]).status == JobStatus.LEASED


def test_an_infinite_number_anywhere_in_a_result_is_400(api, batch):
    job = _claimed(api, batch)
    raw = (
        f'{{"lease_token": "{job["lease_token"]}", '
        f'"result": {{"text": "x", "confidence": [1, -1e999]}}}}'
    ).encode()

    response = api.post(f"/api/v1/jobs/{job['id']}/complete", raw=raw)

    assert response.status_code == 400
    assert response.json()["detail"] == "Numbers must be finite (this one overflows)."
    assert Job.objects.get(pk=job["id"]).result is None


def test_segment_times_at_the_bounds_are_accepted(api, batch):
    job = _claimed(api, batch)
    segments = [
        {"start": 0, "end": 0, "text": "a"},
        {"start": 9_999_999.5, "end": 10_000_000, "text": "b"},
    ]

    response = api.complete(
        job["id"], job["lease_token"], {"text": "ab", "segments": segments}
    )

    assert response.status_code == 200
    assert Job.objects.get(pk=job["id"]).result["segments"] == segments
