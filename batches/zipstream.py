"""A ZIP archive written as a stream, in constant memory.

The standard library's ``zipfile`` keeps an object per member until it writes
the central directory at the end: a million transcripts would hold a million of
them. Here each member's central-directory record is spooled to a temporary
file (on disk past 1 MB) and copied out at the end. Members are small and given
whole, so their CRC and sizes are known before the local header is written
(no data descriptors). ZIP64 records are added when there are more than 65,535
members or the archive passes 4 GiB, as the format requires.
"""

from __future__ import annotations

import struct
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator

ZIP32_LIMIT = 0xFFFFFFFF
COUNT_LIMIT = 0xFFFF
UTF8_FLAG = 0x0800
DEFLATED = 8
VERSION = 45  # 4.5: ZIP64


def _dos_time(moment: time.struct_time) -> tuple[int, int]:
    dos_time = (moment.tm_hour << 11) | (moment.tm_min << 5) | (moment.tm_sec // 2)
    dos_date = ((moment.tm_year - 1980) << 9) | (moment.tm_mon << 5) | moment.tm_mday
    return dos_time, dos_date


def stream_zip(
    members: Iterable[tuple[str, bytes]], *, chunk_size: int = 64 * 1024
) -> Iterator[bytes]:
    """Yield the bytes of a ZIP archive holding ``(name, content)`` members."""
    dos_time, dos_date = _dos_time(time.gmtime())
    offset = 0
    count = 0
    pending = bytearray()
    with tempfile.SpooledTemporaryFile(max_size=1024 * 1024) as directory:
        for name, content in members:
            encoded = name.encode("utf-8")
            crc = zlib.crc32(content)
            compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
            data = compressor.compress(content) + compressor.flush()
            size, csize = len(content), len(data)
            zip64 = offset > ZIP32_LIMIT or size > ZIP32_LIMIT or csize > ZIP32_LIMIT
            local_extra = struct.pack("<HHQQ", 1, 16, size, csize) if zip64 else b""
            pending += struct.pack(
                "<IHHHHHIIIHH",
                0x04034B50,
                VERSION,
                UTF8_FLAG,
                DEFLATED,
                dos_time,
                dos_date,
                crc,
                ZIP32_LIMIT if zip64 else csize,
                ZIP32_LIMIT if zip64 else size,
                len(encoded),
                len(local_extra),
            )
            pending += encoded + local_extra + data
            big_offset = offset > ZIP32_LIMIT
            central_extra = b""
            if zip64 or big_offset:
                fields: tuple[int, ...] = (size, csize) if zip64 else ()
                fields += (offset,) if big_offset else ()
                central_extra = struct.pack(
                    f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields
                )
            directory.write(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    VERSION,
                    VERSION,
                    UTF8_FLAG,
                    DEFLATED,
                    dos_time,
                    dos_date,
                    crc,
                    ZIP32_LIMIT if zip64 else csize,
                    ZIP32_LIMIT if zip64 else size,
                    len(encoded),
                    len(central_extra),
                    0,
                    0,
                    0,
                    0o100644 << 16,
                    ZIP32_LIMIT if big_offset else offset,
                )
                + encoded
                + central_extra
            )
            offset += 30 + len(encoded) + len(local_extra) + csize
            count += 1
            if len(pending) >= chunk_size:
                yield bytes(pending)
                pending.clear()
        if pending:
            yield bytes(pending)
        directory_size = directory.tell()
        directory.seek(0)
        while block := directory.read(chunk_size):
            yield block
    yield _end_records(count, directory_size, offset)


def _end_records(count: int, size: int, start: int) -> bytes:
    records = b""
    if count > COUNT_LIMIT or size > ZIP32_LIMIT or start > ZIP32_LIMIT:
        zip64_end = start + size
        records += struct.pack(
            "<IQHHIIQQQQ",
            0x06064B50,
            44,
            VERSION,
            VERSION,
            0,
            0,
            count,
            count,
            size,
            start,
        )
        records += struct.pack("<IIQI", 0x07064B50, 0, zip64_end, 1)
    records += struct.pack(
        "<IHHHHIIH",
        0x06054B50,
        0,
        0,
        min(count, COUNT_LIMIT),
        min(count, COUNT_LIMIT),
        min(size, ZIP32_LIMIT),
        min(start, ZIP32_LIMIT),
        0,
    )
    return records
