#!/usr/bin/env python3
"""The engine the chaos run gives its workers (``--command``).

Works for a short random time and prints a transcript with segments. For a
source containing ``poison`` it kills the worker that runs it (SIGKILL to its
parent), as a corrupt file that crashes the decoder would: the job's lease
then expires every time, and Recall must fail it after its last attempt
instead of crashing workers forever.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time


def main() -> int:
    source = sys.argv[1]
    if "poison" in source:
        os.kill(os.getppid(), signal.SIGKILL)
        return 1
    time.sleep(random.uniform(0.05, 0.4))
    words = ["recall", "chaos", "lease", "heartbeat", "sweep", "fencing"]
    text = " ".join(random.choice(words) for _ in range(8))
    print(
        json.dumps(
            {"text": text, "segments": [{"start": 0.0, "end": 1.0, "text": text}]}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
