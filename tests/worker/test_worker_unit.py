"""The reference worker's pure parts: results it sends, output it reads, its
command line. No server, no database: these also run in the SQLite pass."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api import worker_views as api
from batches.json_limits import MAX_JSON_DEPTH, nested_deeper_than
from tests.support.worker import WORKER_SCRIPT, load_worker_module

rw = load_worker_module()


def server_accepts(result: dict) -> None:
    """The server's own validation of a completion body: raises if refused."""
    text = json.dumps({"lease_token": "tok", "result": result}, allow_nan=False)
    assert not nested_deeper_than(text, MAX_JSON_DEPTH)
    body = json.loads(text)
    api._check_values(body)
    api._result(body)


# --- Results --------------------------------------------------------------------


def test_normalize_result_repairs_what_the_server_would_refuse():
    result = rw.normalize_result(
        {
            "text": "hello\x00 world \ud800",
            "language": "en",
            "segments": [
                {"start": -0.5, "end": 1.23456, "text": "hello", "tokens": [1, 2]},
                {"start": 2, "end": 1, "text": None},
                {"start": float("nan"), "end": 3, "text": "dropped"},
                {"start": True, "end": 3, "text": "dropped too"},
                "not a segment",
            ],
            "confidence": float("inf"),
        }
    )

    assert result == {
        "text": "hello world ?",
        "language": "en",
        "segments": [
            {"start": 0.0, "end": 1.235, "text": "hello"},
            {"start": 2.0, "end": 2.0, "text": ""},
        ],
        "confidence": None,
    }
    server_accepts(result)


def test_normalize_result_joins_segments_when_text_is_missing():
    result = rw.normalize_result(
        {"segments": [{"start": 0, "end": 1, "text": " a "}, {"start": 1, "end": 2}]}
    )

    assert result["text"] == "a"


def test_normalize_result_refuses_output_that_is_no_transcript():
    with pytest.raises(ValueError, match="neither 'text' nor 'segments'"):
        rw.normalize_result({"language": "en"})
    with pytest.raises(ValueError, match="expected a JSON object"):
        rw.normalize_result([1, 2])


# Strings with what the server refuses: NUL and unpaired surrogates.
nasty_text = st.text() | st.text(st.sampled_from(["a", " ", "\x00", "\ud800", "é"]))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats()
    | nasty_text,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)
segments = st.lists(
    st.fixed_dictionaries(
        {"start": json_values | st.floats(), "end": json_values | st.floats()},
        optional={"text": json_values},
    )
    | json_values,
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "text": nasty_text | json_values,
            "segments": segments | json_values,
            "language": nasty_text | json_values,
            "extra": json_values,
        },
    )
)
def test_whatever_an_engine_prints_the_worker_sends_a_valid_result(data):
    try:
        result = rw.normalize_result(data)
    except ValueError:
        return  # no transcript in it: the job is failed instead
    server_accepts(result)


def nest(levels: int, inner: object = 1) -> object:
    """``inner`` inside ``levels`` arrays (built without recursion)."""
    for _ in range(levels):
        inner = [inner]
    return inner


def test_engine_output_too_deep_or_too_large_for_the_server_is_trimmed(tmp_path):
    # Nested past the server's 32 levels, integers past 1e308 (which overflow
    # math.isfinite and float), and JSON deeper than Python's parser goes.
    result = rw.normalize_result(
        {
            "text": "hi",
            "shallow": nest(30),  # levels 3 to 32 of the body: kept
            "deep": nest(31),  # one level too many: its innermost array is null
            "count": 10**400,  # an integer the server stores as it is
            "segments": [
                {"start": 10**400, "end": 10**401, "text": "a"},
                {"start": 1, "end": 10**400, "text": "b"},
                {"start": 2, "end": 3, "text": "c"},
            ],
        }
    )

    assert result["shallow"] == nest(30)
    assert result["deep"] == nest(30, None)
    assert result["count"] == 10**400
    assert result["segments"] == [{"start": 2.0, "end": 3.0, "text": "c"}]
    server_accepts(result)
    (tmp_path / "result.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"^result\.json is nested too deeply$"):
        rw.parse_output(b"", str(tmp_path))


def test_error_text_is_capped_from_the_end_and_cleaned():
    error = rw.clean_text("start " + "x" * 10_000 + " the real cause\x00", 100)

    assert len(error) == 100
    assert error.startswith("[…]")
    assert error.endswith(" the real cause")


# --- Reading an engine's output ----------------------------------------------------


def test_output_is_read_from_result_json_first(tmp_path):
    (tmp_path / "a.json").write_text('{"text": "a"}')
    (tmp_path / "result.json").write_text('{"text": "result"}')

    assert rw.parse_output(b'{"text": "stdout"}', str(tmp_path)) == {"text": "result"}


def test_output_is_read_from_any_json_file(tmp_path):
    (tmp_path / "talk.json").write_text('{"text": "whisper", "language": "en"}')

    assert rw.parse_output(b"progress...", str(tmp_path)) == {
        "text": "whisper",
        "language": "en",
    }


def test_output_is_read_from_stdout_json_plain_text_or_a_text_file(tmp_path):
    out = str(tmp_path)
    assert rw.parse_output(b'{"text": "all"}\n', out) == {"text": "all"}
    assert rw.parse_output(b'loading\n{"text": "last line"}\n', out) == {
        "text": "last line"
    }
    assert rw.parse_output(b"  just words \n", out) == {"text": "just words"}
    (tmp_path / "x.txt").write_text("from a file\n")
    assert rw.parse_output(b"", out) == {"text": "from a file"}


def test_no_output_or_broken_json_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="wrote no result"):
        rw.parse_output(b"  \n", str(tmp_path))
    (tmp_path / "result.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"result\.json is not valid JSON"):
        rw.parse_output(b"", str(tmp_path))


# --- Command templates --------------------------------------------------------------


def make_job(**changes):
    payload = {
        "job": {
            "id": 42,
            "lease_token": "tok",
            "lease_expires_at": "2026-11-29T23:59:00+00:00",
            "lease_seconds": 60,
            "heartbeat_interval": 20,
            "attempt": 1,
            "max_attempts": 3,
            "batch": {"id": 7, "name": "Interviews"},
            "item": {
                "id": 1234,
                "source": "file:///data/my%20talk.wav",
                "params": {"language": "en", "speakers": 2},
                "duration_seconds": 61.5,
            },
        }
    }
    payload["job"]["item"].update(changes)
    return rw.Job.from_claim(payload)


def test_a_template_is_split_once_and_each_argument_filled_in():
    argv = rw.check_template(
        "whisper {source_path} --language {params[language]} --meta '{params}' "
        "--out {outdir} --id job-{job_id}-{attempt} --dur {duration}"
    )
    values = rw._placeholder_values(make_job(), "/tmp/out")

    assert [a.format(**values) for a in argv] == [
        "whisper",
        "/data/my talk.wav",  # one argument, spaces and all
        "--language",
        "en",
        "--meta",
        '{"language": "en", "speakers": 2}',
        "--out",
        "/tmp/out",
        "--id",
        "job-42-1",
        "--dur",
        "61.5",
    ]


def dashed(value: str, placeholder: str) -> str:
    return (
        f"The command line would get {value!r} for {{{placeholder}}}, which starts "
        f"with '-', which an engine would read as an option; refused without a "
        f"retry, the engine was not started."
    )


@pytest.mark.parametrize(
    ("template", "item", "error"),
    [
        (
            "--language {params[language]} {source_path}",
            {"params": {"language": "--model=../../evil"}},
            dashed("--model=../../evil", "params[language]"),
        ),
        (
            "--language={params[language]} {source_path}",
            {"params": {"language": "-x"}},
            dashed("-x", "params[language]"),
        ),
        (
            "--offset {params[offset]} {source_path}",
            {"params": {"offset": -5}},
            dashed("-5", "params[offset]"),
        ),
        (
            "{source_path}",
            {"source": "file:--output_dir=/etc"},
            dashed("--output_dir=/etc", "source_path"),
        ),
        ("{source_path}", {"source": "file:%2Drf"}, dashed("-rf", "source_path")),
        ("{source_path}", {"source": "FILE:%2d%2dx"}, dashed("--x", "source_path")),
        ("{source}", {"source": "-rf"}, dashed("-rf", "source")),
        (
            "{source_path}",
            {"source": "file:/a%00b"},
            "The command line would get '/ab' for {source_path}, which holds a NUL "
            "character, which no command-line argument can; refused without a "
            "retry, the engine was not started.",
        ),
    ],
)
def test_a_value_an_engine_would_take_for_an_option_fails_for_good_unstarted(
    tmp_path, template, item, error
):
    # The engine would leave a mark: it never runs.
    marker = tmp_path / "engine-ran"
    engine = rw.CommandEngine(
        f"{sys.executable} -c 'open({str(marker)!r}, \"w\")' {template}",
        timeout=None,
        non_retryable=frozenset(),
        workdir=str(tmp_path),
        registry=rw.ProcessRegistry(),
    )

    outcome = engine.run(make_job(**item), rw.Cancellation())

    assert outcome == rw.Failure(error, retryable=False)
    assert not marker.exists()
    assert list(tmp_path.iterdir()) == []  # its output directory is gone too


def test_values_that_only_contain_a_dash_reach_the_engine(tmp_path):
    engine = rw.CommandEngine(
        f"{sys.executable} -c 'import sys; print(*sys.argv[1:])' "
        "{params[language]} {source_path} --x={params[name]}",
        timeout=None,
        non_retryable=frozenset(),
        workdir=str(tmp_path),
        registry=rw.ProcessRegistry(),
    )
    job = make_job(
        source="file:///audio/-a-.wav", params={"language": "en-US", "name": "a-b"}
    )

    outcome = engine.run(job, rw.Cancellation())

    assert outcome == rw.Success({"text": "en-US /audio/-a-.wav --x=a-b"})


def test_a_missing_param_fails_the_job_not_the_worker():
    values = rw._placeholder_values(make_job(params={}), "/tmp/out")

    with pytest.raises(rw.MissingParam):
        "{params[language]}".format(**values)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("", "the command is empty"),
        ("run {src}", "unknown placeholder {src}"),
        ("run {source", "write {{ and }} for braces"),
        ("run 'unclosed", "cannot split the command"),
        ("run {source[0]}", "only {params[NAME]} takes an index"),
        ("run {source.name}", "only {params[NAME]} takes an index"),
    ],
)
def test_bad_templates_are_refused_at_start_up(template, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rw.check_template(template)


def test_source_path_unwraps_file_urls_only():
    assert rw.source_path("file:///a/b%20c.wav") == "/a/b c.wav"
    assert rw.source_path("file://localhost/a.wav") == "/a.wav"
    assert rw.source_path("s3://bucket/a.wav") == "s3://bucket/a.wav"
    assert rw.source_path("/plain/path.wav") == "/plain/path.wav"


# --- Claims, backoff, the simulated engine --------------------------------------------


def test_a_claim_is_read_as_documented():
    job = make_job()

    assert (job.id, job.lease_token, job.heartbeat_interval) == (42, "tok", 20)
    assert (job.item_id, job.duration, job.params["speakers"]) == (1234, 61.5, 2)
    assert job.tag == "job=42 attempt=1/3"
    assert make_job(duration_seconds=None).duration is None


def test_backoff_is_jittered_exponential_and_capped():
    for attempt in range(1, 12):
        ideal = min(30, 0.5 * 2 ** (attempt - 1))
        delays = [rw.backoff_delay(attempt, base=0.5, cap=30) for _ in range(200)]
        assert all(ideal / 2 <= d <= ideal for d in delays)
        assert len(set(delays)) > 1
    # Days of idle polling: the attempt count grows, the delay stays capped.
    assert 15 <= rw.backoff_delay(100_000, base=1, cap=30) <= 30


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("2", 2.0),
        ("0", 0.0),
        ("1.5", 1.5),
        ("86400", rw.MAX_RETRY_AFTER_SECONDS),
        # An HTTP date (RFC 9110), 30 s after "now" below; one passed is no wait.
        ("Wed, 21 Oct 2026 07:28:30 GMT", 30.0),
        ("Wed, 21 Oct 2026 07:27:00 GMT", 0.0),
        ("Wed, 21 Oct 2026 07:28:30 -0000", 30.0),
        (None, None),
        ("", None),
        ("-1", None),
        ("nan", None),
        ("soon", None),
        ("Wed, 99 Oct 2026 07:28:30 GMT", None),
    ],
)
def test_retry_after_is_read_as_seconds_or_an_http_date(header, seconds):
    now = 1792567680.0  # Wed, 21 Oct 2026 07:28:00 GMT

    assert rw._retry_after(header, now=now) == seconds


def test_simulated_transcripts_cover_the_audio_and_repeat_per_item():
    transcript = rw.simulated_transcript(7, 95.0)

    assert transcript == rw.simulated_transcript(7, 95.0)
    assert transcript["segments"][0]["start"] == 0
    assert 90 < transcript["segments"][-1]["end"] <= 95
    assert all(s["start"] <= s["end"] for s in transcript["segments"])
    server_accepts(transcript)


# --- The command line -----------------------------------------------------------------


def run_worker(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(WORKER_SCRIPT), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=30,
    )


def test_help_documents_every_option_and_its_environment_variable():
    result = run_worker("--help")

    assert result.returncode == 0
    for action in rw.build_parser()._actions:
        for option in action.option_strings:
            assert option in result.stdout
        if action.dest not in ("help", "version"):
            assert "[env" in action.help, action.dest
    for placeholder in rw.PLACEHOLDERS:
        assert "{" + placeholder + "}" in result.stdout
    assert "65, 66" in result.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--simulate"], {"RECALL_TOKEN": "t" * 20}, "set the server's URL"),
        (["--simulate"], {"RECALL_URL": "http://x"}, "set the worker token"),
        (
            ["--url", "ftp://x", "--simulate", "--token", "t" * 20],
            {},
            "must be an http",
        ),
        (["--url", "http://x", "--token", "t" * 20], {}, "choose an engine"),
        (
            [
                "--url",
                "http://x",
                "--token",
                "t" * 20,
                "--command",
                "nonexistent-x {source}",
            ],
            {},
            "'nonexistent-x' is not an executable on PATH",
        ),
        (
            ["--url", "http://x", "--token", "t" * 20, "--command", "cat {file}"],
            {},
            "unknown placeholder {file}",
        ),
        (
            ["--simulate"],
            {
                "RECALL_URL": "http://x",
                "RECALL_TOKEN": "t" * 20,
                "RECALL_WORKER_CONCURRENCY": "0",
            },
            "must be at least 1",
        ),
    ],
)
def test_bad_command_lines_exit_2_with_a_message(args, env, message):
    result = run_worker(*args, env=env)

    assert result.returncode == 2
    assert message in result.stderr


def test_finite_checks_do_not_let_nan_through():
    assert not rw._is_number(math.nan)
    assert not rw._is_number(math.inf)
    assert not rw._is_number(False)
    assert rw._is_number(0)
