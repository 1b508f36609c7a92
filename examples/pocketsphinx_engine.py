#!/usr/bin/env python3
"""Transcribe a WAV file offline with pocketsphinx: a real engine for Recall.

Usage, with the reference worker::

    pip install pocketsphinx
    python3 recall_worker.py --command \\
        'python3 examples/pocketsphinx_engine.py {source_path}'

It prints one JSON object on stdout: ``text``, ``language`` ("en") and timed
``segments`` (phrases split at pauses, in seconds), plus ``words`` with their
own times. pocketsphinx's US English model ships inside the PyPI package, so
nothing is downloaded at run time.

The audio must be uncompressed PCM WAV (8, 16, 24 or 32 bits, any rate, any
number of channels); it is mixed to mono and resampled to 16 kHz here, in pure
Python. For other formats, convert first (``ffmpeg -i in.mp3 -ar 16000 -ac 1
out.wav``) in a small wrapper script.

Exit statuses follow the worker's convention: 66 when the file does not exist
or cannot be read, 65 when it is not audio this engine can decode (neither is
worth a retry), 1 for anything unexpected (retried).
"""

from __future__ import annotations

import argparse
import array
import io
import json
import math
import sys
import urllib.parse
import wave
from operator import mul

EX_DATAERR = 65  # the input is not audio we can decode: do not retry
EX_NOINPUT = 66  # the input does not exist or cannot be read: do not retry

SAMPLE_RATE = 16_000  # what the bundled acoustic model expects
FRAMES_PER_SECOND = 100  # pocketsphinx's segment times are in 10 ms frames
# A pause at least this long between words starts a new segment.
PHRASE_PAUSE_SECONDS = 0.3
# Half the length, in input samples, of the resampling filter.
FILTER_HALF_TAPS = 16


class InputError(Exception):
    """The input will never decode; ``status`` says which kind (65 or 66)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def local_path(source: str) -> str:
    """Accept a plain path or a ``file://`` URL."""
    parsed = urllib.parse.urlsplit(source)
    if parsed.scheme == "file":
        return urllib.parse.unquote(parsed.path)
    return source


def read_wav(path: str) -> tuple[array.array, int]:
    """The file's samples as 16-bit mono, and its sample rate."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (wave.open closes it)
    except OSError as error:
        raise InputError(EX_NOINPUT, f"cannot open {path}: {error.strerror}") from None
    try:
        with wave.open(f) as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as error:
        reason = str(error) or "truncated file"
        raise InputError(
            EX_DATAERR,
            f"{path} is not a PCM WAV file this engine can read ({reason}); "
            f"convert it, e.g. with ffmpeg -ar 16000 -ac 1",
        ) from None
    finally:
        f.close()
    if rate <= 0:
        raise InputError(EX_DATAERR, f"{path} has an invalid sample rate {rate}")
    samples = to_int16(raw, width)
    return mix_to_mono(samples, channels), rate


def to_int16(raw: bytes, width: int) -> array.array:
    """Little-endian PCM of any common width as signed 16-bit samples."""
    if width == 2:
        samples = array.array("h", raw[: len(raw) // 2 * 2])
        if sys.byteorder == "big":
            samples.byteswap()
        return samples
    if width == 1:  # 8-bit WAV is unsigned
        return array.array("h", ((b - 128) << 8 for b in raw))
    if width in (3, 4):  # keep the two most significant bytes of each sample
        n = len(raw) // width
        out = bytearray(2 * n)
        out[0::2] = raw[width - 2 :: width][:n]
        out[1::2] = raw[width - 1 :: width][:n]
        samples = array.array("h", bytes(out))
        if sys.byteorder == "big":
            samples.byteswap()
        return samples
    raise InputError(EX_DATAERR, f"unsupported sample width: {width} bytes")


def mix_to_mono(samples: array.array, channels: int) -> array.array:
    if channels == 1:
        return samples
    frames = len(samples) // channels
    lanes = [samples[c::channels][:frames] for c in range(channels)]
    return array.array(
        "h", (sum(frame) // channels for frame in zip(*lanes, strict=True))
    )


def resample(samples: array.array, rate_in: int, rate_out: int) -> array.array:
    """Resample 16-bit audio with a windowed-sinc polyphase filter.

    Good enough for speech recognition and standard library only: about 30 ms
    of CPU per second of audio. The low-pass cut-off sits just under the lower
    of the two Nyquist frequencies, so downsampling does not alias.
    """
    if rate_in == rate_out:
        return samples
    g = math.gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    cutoff = min(1.0, up / down) * 0.92
    half = FILTER_HALF_TAPS
    phases: dict[int, list[float]] = {}

    def taps(phase: int) -> list[float]:
        weights = []
        for k in range(2 * half):
            t = phase / up + half - 1 - k  # distance to the input sample, in samples
            x = math.pi * cutoff * t
            sinc = cutoff * (math.sin(x) / x if x else 1.0)
            window = 0.5 + 0.5 * math.cos(math.pi * t / half) if abs(t) < half else 0
            weights.append(sinc * window)
        total = sum(weights)
        return [w / total for w in weights]

    zeros = array.array("h", bytes(2 * half))
    padded = zeros + samples + zeros
    n_out = len(samples) * up // down
    out = array.array("h", bytes(2 * n_out))
    for n in range(n_out):
        i, phase = divmod(n * down, up)
        weights = phases.get(phase)
        if weights is None:
            weights = phases[phase] = taps(phase)
        value = round(sum(map(mul, padded[i + 1 : i + 1 + 2 * half], weights)))
        out[n] = -32768 if value < -32768 else 32767 if value > 32767 else value
    return out


def transcribe(pcm: bytes) -> dict:
    """Decode 16 kHz mono 16-bit PCM: speech regions by voice activity, then
    words, grouped into phrases at pauses."""
    from pocketsphinx import Decoder, Segmenter, set_loglevel

    set_loglevel("ERROR")
    decoder = Decoder(samprate=SAMPLE_RATE, loglevel="ERROR")
    words: list[dict] = []
    for region in Segmenter(sample_rate=SAMPLE_RATE).segment(io.BytesIO(pcm)):
        decoder.start_utt()
        decoder.process_raw(region.pcm, full_utt=True)
        decoder.end_utt()
        for seg in decoder.seg():
            word = seg.word.split("(", 1)[0]  # "the(2)": an alternative pronunciation
            if word.startswith(("<", "[")):  # <s>, </s>, <sil>, [NOISE]
                continue
            words.append(
                {
                    "start": round(region.start_time + seg.start_frame / 100, 2),
                    "end": round(region.start_time + (seg.end_frame + 1) / 100, 2),
                    "word": word,
                }
            )
    segments = phrases(words)
    return {
        "text": " ".join(s["text"] for s in segments),
        "language": "en",
        "segments": segments,
        "words": words,
    }


def phrases(words: list[dict]) -> list[dict]:
    """Group timed words into segments, starting a new one at each long pause."""
    segments: list[dict] = []
    for word in words:
        if segments and word["start"] - segments[-1]["end"] < PHRASE_PAUSE_SECONDS:
            segments[-1]["end"] = word["end"]
            segments[-1]["text"] += " " + word["word"]
        else:
            segments.append(
                dict(start=word["start"], end=word["end"], text=word["word"])
            )
    return segments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a WAV file: a path or a file:// URL")
    args = parser.parse_args(argv)
    try:
        samples, rate = read_wav(local_path(args.source))
    except InputError as error:
        print(f"pocketsphinx_engine: {error}", file=sys.stderr)
        return error.status
    pcm = resample(samples, rate, SAMPLE_RATE).tobytes()  # native byte order
    json.dump(transcribe(pcm), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
