"""A scriptable engine for the worker tests: ``fake_engine.py MODE SOURCE``.

MODE says what it does, so each test item can ask for its own behaviour through
its ``mode`` param (``--command '... {params[mode]} {source}'``):

* ``json``: print a JSON result on stdout;
* ``outfile``: write the result to ``$RECALL_OUTDIR/result.json``;
* ``text``: print plain text;
* ``exit:N``: complain on stderr and exit with status N;
* ``hang``: record its pid and a child's in ``$FAKE_ENGINE_DIR`` and sleep;
* ``hang-once``: ``hang`` the first time for this source, ``json`` after that.

Every run also leaves ``<job id>.ran`` in ``$FAKE_ENGINE_DIR`` (when set), so
a test can tell which jobs an engine was started for. A hanging engine gives up
by itself after HANG_SECONDS, so a failed test never leaves it running for long.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HANG_SECONDS = 30


def result(source: str) -> dict:
    return {
        "text": f"fake transcript of {source}",
        "segments": [
            {"start": 0, "end": 1.5, "text": "fake transcript"},
            {"start": 1.5, "end": 2, "text": f"of {source}"},
        ],
        "language": "en",
        # What the engine saw of its environment, for the tests to check.
        "saw_token": any(k.startswith("RECALL_TOKEN") for k in os.environ),
        "saw_job_id": os.environ.get("RECALL_JOB_ID"),
    }


def hang(source: str) -> None:
    child = subprocess.Popen(["sleep", str(HANG_SECONDS)])
    directory = Path(os.environ["FAKE_ENGINE_DIR"])
    record = {
        "pid": os.getpid(),
        "child": child.pid,
        "job": os.environ["RECALL_JOB_ID"],
        "source": source,
    }
    (directory / f"{os.getpid()}.json").write_text(json.dumps(record))
    time.sleep(HANG_SECONDS)
    print(json.dumps(result(source)))


def main() -> int:
    if directory := os.environ.get("FAKE_ENGINE_DIR"):
        (Path(directory) / f"{os.environ.get('RECALL_JOB_ID')}.ran").touch()
    mode, source = sys.argv[1], sys.argv[2]
    if mode == "json":
        print("loading model...")  # noise before the JSON line
        print(json.dumps(result(source)))
    elif mode == "outfile":
        out = Path(os.environ["RECALL_OUTDIR"]) / "result.json"
        out.write_text(json.dumps(result(source)))
    elif mode == "text":
        print(f"  plain transcript of {source}  ")
    elif mode.startswith("exit:"):
        print("decoding...\nerror: the decoder gave up on this file", file=sys.stderr)
        return int(mode.split(":", 1)[1])
    elif mode == "hang":
        hang(source)
    elif mode == "hang-once":
        marker = Path(os.environ["FAKE_ENGINE_DIR"]) / f"{Path(source).name}.seen"
        if marker.exists():
            print(json.dumps(result(source)))
        else:
            marker.touch()
            hang(source)
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
