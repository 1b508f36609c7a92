import pytest

from batches.models import COUNTER_SHARDS, Batch, BatchCounter, BatchItem
from engine.manifests import (
    Entry,
    LineError,
    ManifestInvalid,
    create_batch,
    parse_manifest,
)
from jobs.models import Job, JobStatus
from tests.support.factories import assert_consistent


def parse(text: str | bytes) -> list:
    data = text.encode() if isinstance(text, str) else text
    return list(parse_manifest(data.splitlines(keepends=True)))


def test_plain_lines_skip_blanks_and_comments():
    assert parse("# my batch\n\n/a.wav\n  s3://b/c d.mp3  \r\n#/skipped.wav\n") == [
        Entry(3, "/a.wav", {}, None),
        Entry(4, "s3://b/c d.mp3", {}, None),
    ]


def test_a_plain_source_may_contain_commas():
    assert parse("/a,b.wav\n") == [Entry(1, "/a,b.wav", {}, None)]


def test_csv_with_source_durations_and_params():
    text = "# exported\nSource,duration_seconds,language,speaker\n/a.wav,61.5,en,\n/b.wav,,de,Ann\n"

    assert parse(text) == [
        Entry(3, "/a.wav", {"language": "en"}, 61_500),
        Entry(4, "/b.wav", {"language": "de", "speaker": "Ann"}, None),
    ]


def test_csv_quoted_fields_and_bom():
    text = '\ufeffsource,note\n"/with, comma.wav","multi\nline"\n/c.wav,x\n'

    assert parse(text) == [
        Entry(2, "/with, comma.wav", {"note": "multi\nline"}, None),
        Entry(4, "/c.wav", {"note": "x"}, None),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("source,duration_seconds\n/a.wav,abc\n", LineError(2, "duration_seconds 'abc' is not a number")),
        ("source,duration_seconds\n/a.wav,-1\n", LineError(2, "duration_seconds '-1' must be a number of seconds, 0 or more")),
        ("source,duration_seconds\n/a.wav,nan\n", LineError(2, "duration_seconds 'nan' must be a number of seconds, 0 or more")),
        ("source,duration_seconds\n/a.wav,1e9\n", LineError(2, "duration_seconds '1e9' is more than 10000000")),
        ("source,x\n,1\n", LineError(2, "the source is empty")),
        ("source,x\n/a.wav\n", LineError(2, "expected 2 columns, found 1")),
        ("source,x,x\n/a.wav,1,2\n", LineError(1, "duplicate column(s) in the header: x")),
        ("source,\n/a.wav,1\n", LineError(1, "a column in the header has no name")),
        ("/a\x01.wav\n", LineError(1, "the source contains a control character")),
        ("/" + "a" * 5000 + "\n", LineError(1, "the source is longer than 4096 characters")),
    ],
)  # fmt: skip
def test_bad_lines_are_reported_with_their_line_number(text, error):
    assert error in parse(text)


def test_invalid_utf8_is_reported_per_line():
    result = parse(b"/a.wav\n/\xff\xfe.wav\n/c.wav\n")

    assert result == [
        Entry(1, "/a.wav", {}, None),
        LineError(2, "not valid UTF-8 text"),
        Entry(3, "/c.wav", {}, None),
    ]


@pytest.mark.django_db
def test_create_batch_creates_items_jobs_and_counters():
    lines = ["source,duration_seconds,lang\n"] + [
        f"/a{i}.wav,{i},en\n" for i in range(40)
    ]

    batch = create_batch(" Interviews ", lambda: iter(lines), priority=3)

    assert (batch.name, batch.priority, batch.total) == ("Interviews", 3, 40)
    assert batch.total_ms == sum(range(40)) * 1000
    assert batch.durations_known is True  # a duration of 0 is still a duration
    items = list(BatchItem.objects.filter(batch=batch).order_by("pk"))
    assert [i.source for i in items] == [f"/a{i}.wav" for i in range(40)]
    assert items[5].params == {"lang": "en"}
    assert items[5].duration_seconds == 5.0
    jobs = Job.objects.filter(batch=batch)
    assert jobs.count() == 40
    assert set(jobs.values_list("status", "attempts", "max_attempts")) == {
        (JobStatus.QUEUED, 0, 3)
    }
    assert BatchCounter.objects.filter(batch=batch).count() == COUNTER_SHARDS
    counts = batch.counts()
    assert (counts["queued"], counts["queued_ms"]) == (40, sum(range(40)) * 1000)
    assert_consistent()


@pytest.mark.django_db
def test_durations_known_only_when_every_item_has_one():
    full = create_batch(
        "a", lambda: iter(["source,duration_seconds\n", "/a,1\n", "/b,2\n"])
    )
    partial = create_batch(
        "b", lambda: iter(["source,duration_seconds\n", "/a,1\n", "/b,\n"])
    )
    plain = create_batch("c", lambda: iter(["/a\n"]))

    assert (full.durations_known, partial.durations_known, plain.durations_known) == (
        True,
        False,
        False,
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["# nothing\n", "\n"], "the manifest has no sources"),
        (
            ["/ok.wav\n", "/bad\x00.wav\n"],
            "line 2: the source contains a control character",
        ),
    ],
)
def test_an_invalid_manifest_creates_nothing(lines, message):
    with pytest.raises(ManifestInvalid) as raised:
        create_batch("x", lambda: iter(lines))

    assert message in str(raised.value)
    assert not Batch.objects.exists()
    assert not BatchItem.objects.exists()
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_all_errors_are_reported_up_to_a_limit():
    lines = ["source,d\n"] + [",x\n"] * 150

    with pytest.raises(ManifestInvalid) as raised:
        create_batch("x", lambda: iter(lines))

    assert raised.value.total_errors == 150
    assert len(raised.value.errors) == 100
    assert str(raised.value).endswith("… and 50 more errors")


@pytest.mark.django_db
def test_the_item_limit_is_enforced(settings):
    settings.RECALL_MAX_MANIFEST_ITEMS = 3

    with pytest.raises(
        ManifestInvalid, match="the manifest has 4 items; the limit is 3"
    ):
        create_batch("x", lambda: iter(["/a\n", "/b\n", "/c\n", "/d\n"]))
    assert not Batch.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["", "   ", "x" * 201, "bad\nname"])
def test_the_batch_name_is_checked(name):
    with pytest.raises(ManifestInvalid):
        create_batch(name, lambda: iter(["/a\n"]))


# --- Hostile sources ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("/audio/\u202egnp.wav", "the source contains an invisible formatting character (U+202E; bidirectional overrides and zero-width characters hide what a source really is)"),
        ("/audio/a\u200bb.wav", "the source contains an invisible formatting character (U+200B; bidirectional overrides and zero-width characters hide what a source really is)"),
        ("/audio/\u0085next.wav", "the source contains a control character"),
        ("/audio/a\x7f.wav", "the source contains a control character"),
        ("--output=/etc/passwd", "the source starts with '-', which an engine would read as an option (write ./-name for a file whose name starts with '-')"),
        ("ftp://example.com/a.wav", "the scheme 'ftp:' is not allowed; use a plain path or one of s3:, gs:, az:, http:, https:, file: (RECALL_SOURCE_SCHEMES)"),
        ("data:audio/wav;base64,UklGRg==", "the scheme 'data:' is not allowed; use a plain path or one of s3:, gs:, az:, http:, https:, file: (RECALL_SOURCE_SCHEMES)"),
        ("JavaScript:alert(1)", "the scheme 'javascript:' is not allowed; use a plain path or one of s3:, gs:, az:, http:, https:, file: (RECALL_SOURCE_SCHEMES)"),
    ],
)  # fmt: skip
def test_hostile_sources_are_refused_with_their_line_number(source, message):
    assert parse(f"/ok.wav\n{source}\n") == [
        Entry(1, "/ok.wav", {}, None),
        LineError(2, message),
    ]


def test_a_hostile_source_in_a_csv_manifest_is_refused_too():
    assert parse("source,lang\n/ok.wav,en\n-rf,en\n") == [
        Entry(2, "/ok.wav", {"lang": "en"}, None),
        LineError(3, "the source starts with '-', which an engine would read as an option (write ./-name for a file whose name starts with '-')"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "source",
    [
        "/data/a.wav",
        "relative/b.wav",
        "./-dash.wav",
        "C:\\audio\\c.wav",
        "S3://Bucket/d.flac",
        "gs://b/e.wav",
        "az://c/f.wav",
        "https://cdn.example.com/g.mp3?sig=a-b",
        "file:///audio/h.wav",
        "/audio/naïve café — ünïcode.wav",
        "/audio/a:b.wav",
    ],
)
def test_plain_paths_and_allowed_schemes_are_accepted(source):
    assert parse(f"{source}\n") == [Entry(1, source, {}, None)]


def test_the_allowed_schemes_are_a_setting(settings):
    settings.RECALL_SOURCE_SCHEMES = ["s3"]

    assert parse("s3://b/a.wav\nhttps://x/b.wav\n/c.wav\n") == [
        Entry(1, "s3://b/a.wav", {}, None),
        LineError(2, "the scheme 'https:' is not allowed; use a plain path or one of s3: (RECALL_SOURCE_SCHEMES)"),
        Entry(3, "/c.wav", {}, None),
    ]  # fmt: skip


@pytest.mark.django_db
def test_a_manifest_with_one_hostile_source_creates_nothing():
    lines = ["/a.wav\n", "ftp://x/b.wav\n"]

    with pytest.raises(
        ManifestInvalid, match=r"line 2: the scheme 'ftp:' is not allowed"
    ):
        create_batch("x", lambda: iter(lines))
    assert not Batch.objects.exists()
