"""The streaming ZIP writer produces archives the standard library reads back."""

import io
import zipfile

from batches.zipstream import stream_zip


def _read(chunks) -> zipfile.ZipFile:
    return zipfile.ZipFile(io.BytesIO(b"".join(chunks)))


def test_members_round_trip():
    members = [
        ("a.txt", b"hello"),
        ("dir/b.srt", b"1\n00:00:00,000 --> x\n"),
        ("empty.txt", b""),
    ]

    archive = _read(stream_zip(iter(members)))

    assert archive.testzip() is None
    assert [(i.filename, archive.read(i)) for i in archive.infolist()] == members


def test_unicode_names():
    archive = _read(stream_zip([("Ärger – 日本.txt", "grüße".encode())]))

    assert archive.namelist() == ["Ärger – 日本.txt"]
    assert archive.read("Ärger – 日本.txt").decode() == "grüße"


def test_an_empty_archive():
    assert _read(stream_zip([])).namelist() == []


def test_more_than_65535_members_uses_zip64():
    n = 70_000
    archive = _read(stream_zip((f"{i}.txt", str(i).encode()) for i in range(n)))

    assert len(archive.infolist()) == n
    assert archive.read("69999.txt") == b"69999"


def test_output_comes_in_bounded_chunks():
    members = ((f"{i}.txt", b"x" * 1000) for i in range(500))

    sizes = [len(chunk) for chunk in stream_zip(members, chunk_size=4096)]

    assert len(sizes) > 10
    assert max(sizes) < 4096 + 2000
