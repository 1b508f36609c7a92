"""The pocketsphinx example engine: on its own, and through Recall with the
reference worker, on sentences spoken by espeak-ng (a synthetic voice and a
small model: the words come back imperfectly, but they come back, timed)."""

from __future__ import annotations

import array
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest
from django.utils import timezone

from engine.manifests import create_batch
from jobs.models import Job, JobStatus
from tests.support.factories import jobs_of, make_worker
from tests.support.worker import ROOT, wait_for

ENGINE = ROOT / "examples" / "pocketsphinx_engine.py"
SENTENCES = [
    "Please call Stella and ask her to bring these things with her from the store.",
    "I would like to order a cup of coffee please. Thank you very much.",
    "Hello, my name is John. I live in New York.",
]


@pytest.fixture(scope="module")
def spoken(tmp_path_factory) -> list[tuple[Path, str, float]]:
    """The sentences as WAV files: (path, sentence, seconds)."""
    if shutil.which("espeak-ng") is None:
        if os.environ.get("CI"):
            pytest.fail("espeak-ng is missing (.ci/run installs it)")
        pytest.skip("needs espeak-ng (apt-get install espeak-ng)")
    directory = tmp_path_factory.mktemp("speech")
    files = []
    for n, sentence in enumerate(SENTENCES):
        path = directory / f"sentence {n}.wav"  # a space, to check quoting
        subprocess.run(
            ["espeak-ng", "-v", "en-us", "-s", "140", "-w", str(path), sentence],
            check=True,
            capture_output=True,
        )
        with wave.open(str(path)) as w:
            files.append((path, sentence, w.getnframes() / w.getframerate()))
    return files


def engine(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ENGINE), *args], capture_output=True, text=True, timeout=60
    )


def words(text: str) -> set[str]:
    return {w.strip(".,").lower() for w in text.split()}


def check_transcript(result: dict, sentence: str, seconds: float) -> int:
    """Timed segments within the audio; returns how many words it got right."""
    assert result["language"] == "en"
    segments = result["segments"]
    assert segments
    assert result["text"] == " ".join(s["text"] for s in segments)
    previous_end = 0.0
    for segment in segments:
        assert previous_end <= segment["start"] <= segment["end"] <= seconds + 0.05
        assert segment["text"]
        previous_end = segment["end"]
    return len(words(result["text"]) & words(sentence))


def load_engine():
    spec = importlib.util.spec_from_file_location("pocketsphinx_engine", ENGINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_resampler_keeps_a_tone_in_tune():
    resample = load_engine().resample
    rate, tone = 22_050, 440.0
    signal = array.array(
        "h",
        (round(8000 * math.sin(2 * math.pi * tone * n / rate)) for n in range(rate)),
    )

    out = resample(signal, rate, 16_000)

    assert len(out) == 16_000
    ideal = [8000 * math.sin(2 * math.pi * tone * n / 16_000) for n in range(16_000)]
    middle = range(100, 15_900)  # away from the zero-padded edges
    error = math.sqrt(sum((out[n] - ideal[n]) ** 2 for n in middle) / len(middle))
    assert error < 80  # under 1% of the amplitude


def test_engine_exit_statuses_say_whether_to_retry(tmp_path):
    missing = engine(str(tmp_path / "missing.wav"))
    assert missing.returncode == 66
    assert "cannot open" in missing.stderr

    (tmp_path / "not-audio.wav").write_text("hello")
    bad = engine(f"file://{tmp_path / 'not-audio.wav'}")
    assert bad.returncode == 65
    assert "is not a PCM WAV file" in bad.stderr


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_spoken_sentences_come_back_through_recall_as_timed_transcripts(
    spoken, start_worker
):
    lines = ["source,duration_seconds\n"] + [
        f"{path.as_uri()},{seconds:.3f}\n" for path, _, seconds in spoken
    ]
    batch = create_batch("speech", lambda: iter(lines), now=timezone.now())
    proc = start_worker(
        make_worker(),
        "--command",
        f"{sys.executable} {ENGINE} {{source_path}}",
        "--concurrency=2",
    )

    wait_for(
        lambda: (
            not Job.objects.filter(batch=batch)
            .exclude(status=JobStatus.COMPLETED)
            .exists()
        ),
        timeout=90,
        what="every sentence transcribed",
        workers=(proc,),
    )

    right = 0
    for job, (_, sentence, seconds) in zip(jobs_of(batch), spoken, strict=True):
        right += check_transcript(job.result, sentence, seconds)
    # A synthetic voice and a small model: many words are wrong, not all.
    assert right >= 3
