"""The manifest upload's size limit, enforced while the body is read.

Django's upload handlers see the file as it arrives, in chunks of 64 kB. This
one sits first: it refuses an upload whose declared size cannot fit before
reading any of it, and stops reading one chunk past RECALL_MAX_MANIFEST_BYTES,
so an oversized manifest is never written to disk whole (the form's own size
check only runs once it is). A file over the limit by less than that chunk is
read whole and refused by the form, which can then say exactly how large it is.
"""

from __future__ import annotations

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler

# Room for the form's other fields and the multipart framing around the file.
OTHER_FIELDS_BYTES = 64 * 1024


class ManifestTooLarge(Exception):
    """The upload passed the limit; nothing more of it is read."""

    def __init__(self, limit: int):
        super().__init__(f"the manifest is larger than {limit} bytes")
        self.limit = limit


class ManifestSizeLimit(FileUploadHandler):
    """Count the bytes of every file in the request; past ``limit``, stop.

    Raises ManifestTooLarge out of the request's body parsing: the view turns
    it into a 413 page. The handlers after this one (Django's, which spool to
    memory or a temporary file) never see the chunk that crossed the line.
    """

    def __init__(self, request=None, *, limit: int | None = None):
        super().__init__(request)
        self.limit = settings.RECALL_MAX_MANIFEST_BYTES if limit is None else limit
        self.received = 0

    def handle_raw_input(
        self, input_data, META, content_length, boundary, encoding=None
    ):
        # Pasted text has its own limit (DATA_UPLOAD_MAX_MEMORY_SIZE); a body
        # larger than both together cannot be a valid form: read none of it.
        text_limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0
        most = self.limit + text_limit + OTHER_FIELDS_BYTES
        if content_length > most:
            raise ManifestTooLarge(self.limit)
        return None

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        self.received += len(raw_data)
        if self.received > self.limit + self.chunk_size:
            raise ManifestTooLarge(self.limit)
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None
