"""Reading what the browser painted: pixels from a PNG screenshot.

A small PNG decoder (8-bit RGB or RGBA, not interlaced: what Chromium's
screenshots are), so a test can check the colour at a position on screen
rather than the CSS that was meant to produce it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

RGB = tuple[int, int, int]


@dataclass(frozen=True)
class Image:
    width: int
    height: int
    channels: int
    rows: list[bytes]

    def at(self, x: float, y: float) -> RGB:
        """The colour of the pixel at (x, y), in CSS pixels of a scale-1 shot."""
        row = self.rows[int(y)]
        i = int(x) * self.channels
        return row[i], row[i + 1], row[i + 2]


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def decode(png: bytes) -> Image:
    """Decode a PNG (colour types 2 and 6, bit depth 8, no interlace)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, data = 8, b""
    width = height = channels = 0
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind = png[pos + 4 : pos + 8]
        body = png[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(
                ">IIBBBBB", body
            )
            assert depth == 8 and colour in (2, 6) and interlace == 0, "unsupported"
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            data += body
        elif kind == b"IEND":
            break
    raw = zlib.decompress(data)
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            up_left = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                line[i] = (line[i] + _paeth(left, up, up_left)) & 0xFF
        rows.append(bytes(line))
        previous = line
    return Image(width, height, channels, rows)


def hex_rgb(colour: str) -> RGB:
    colour = colour.lstrip("#")
    if len(colour) == 3:
        colour = "".join(c * 2 for c in colour)
    return int(colour[0:2], 16), int(colour[2:4], 16), int(colour[4:6], 16)


def close(a: RGB, b: RGB, tolerance: int = 6) -> bool:
    return all(abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))
