"""Date and time formats for English: Django's, with seconds.

Leases last seconds, so a time shown to the minute ("2:53 a.m.") hides what
an operator needs; the admin shows lease, heartbeat and expiry times with
seconds, on a 24-hour clock as the operator pages do.
"""

DATETIME_FORMAT = "N j, Y, H:i:s"
TIME_FORMAT = "H:i:s"
