#!/usr/bin/env python3
"""recallctl: submit, follow and collect Recall batches from a pipeline.

One file, Python 3.11+ standard library only: copy it anywhere. It speaks
Recall's operator API with a personal API token (the "API tokens" page, or
``manage.py create_api_token USERNAME``):

    export RECALL_URL=https://recall.example RECALL_API_TOKEN=rct_...
    recallctl.py submit calls.csv --name "calls 2026-01-01" --wait
    recallctl.py submit calls.csv --require gpu=a100 --require model=large-v3
    recallctl.py status 12
    recallctl.py wait 12
    recallctl.py export 12 --format csv -o calls.csv
    recallctl.py cancel 12
    recallctl.py retry 12 [--source-contains 2026-01-01]

``submit`` is idempotent: it sends an Idempotency-Key derived from the
manifest's content and the batch name (or --idempotency-key), so running it
again (after a lost response, a killed job) gives the batch it already made.

Exit status: 0 done; for ``wait`` and ``submit --wait``, 0 when the batch
finished with no failed item, 1 when some failed, 2 when it was cancelled,
3 when --timeout ran out; 4 on any error (one readable line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import ipaddress
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, NoReturn

EXIT_OK, EXIT_FAILED_ITEMS, EXIT_CANCELLED, EXIT_TIMEOUT, EXIT_ERROR = 0, 1, 2, 3, 4
FINAL_STATES = ("finished", "cancelled")
# Transient answers while waiting: retried, not fatal.
RETRY_STATUSES = (429, 502, 503, 504)
USER_AGENT = "recallctl/1"


class Failure(Exception):
    """Something the user must hear about, in one line."""


class RedirectRefused(Failure):
    """The server redirected to another origin: waiting will not fix that."""


class ApiError(Failure):
    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


# --- HTTP ---------------------------------------------------------------------


def origin(url: str) -> tuple[str, str, int | None]:
    """Scheme, host and port (the default one filled in): what must not change
    for a request to carry the token."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").rstrip(".").lower(), port


def plain_http_warning(url: str) -> str | None:
    """A warning when ``url`` sends the token in clear text over a network
    (the reference worker's rule: plain http:// to another machine)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "http":
        return None
    host = (parts.hostname or "").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return None
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return None
    return (
        f"RECALL_URL is plain http:// to {host!r}, which is not this machine: the "
        f"API token and everything it fetches cross the network unencrypted; use "
        f"https://"
    )


class SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only within the origin the request went to: the
    request carries the API token, and urllib would otherwise send it to
    whatever scheme, host and port a ``Location`` names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if origin(newurl) != origin(req.full_url):
            scheme, host, port = origin(req.full_url)
            raise RedirectRefused(
                f"the server redirected ({code}) to {newurl}, which is not "
                f"{scheme}://{host}:{port}; recallctl never sends its API token "
                f"to another scheme, host or port. If that is Recall's address, "
                f"set RECALL_URL to it"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class Client:
    def __init__(self, url: str, token: str, timeout: float = 60):
        self.base = url.rstrip("/")
        self.token, self.timeout = token, timeout
        self.opener = urllib.request.build_opener(SameOriginRedirects)

    def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        headers: dict[str, str] | None = None,
    ):
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Accept": "application/json",
                "User-Agent": USER_AGENT,
                **({"Content-Type": "application/json"} if data is not None else {}),
                **(headers or {}),
            },
        )
        try:
            return self.opener.open(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            raise _api_error(error) from None
        except urllib.error.URLError as error:
            raise Failure(f"cannot reach {self.base}: {error.reason}") from None
        except (TimeoutError, ConnectionError) as error:
            raise Failure(f"cannot reach {self.base}: {error}") from None

    def json(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict]:
        with self._request(method, path, body, headers) as response:
            raw = response.read()
            try:
                return response.status, json.loads(raw)
            except ValueError:
                raise Failure(
                    f"{self.base}{path} did not answer JSON (is RECALL_URL right?)"
                ) from None

    def download(self, path: str, out) -> int:
        """Stream the response body into ``out``; how many bytes."""
        size = 0
        with self._request("GET", path) as response:
            while chunk := response.read(1 << 16):
                out.write(chunk)
                size += len(chunk)
        return size


def _api_error(error: urllib.error.HTTPError) -> Failure:
    try:
        body = json.loads(error.read())
        return ApiError(error.code, body["error"], body["detail"])
    except (ValueError, KeyError, TypeError):
        return ApiError(error.code, "http_error", error.reason or "no detail")


# --- Manifests -------------------------------------------------------------------


def read_manifest(path: str) -> tuple[bytes, list[dict]]:
    """The manifest's bytes and its items, in Recall's manifest format: one
    source per line (blank lines and # comments skipped), or CSV with a
    'source' column (optional 'duration_seconds'; other columns become params)."""
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as error:
        raise Failure(f"cannot read {path}: {error.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise Failure(f"{path} is not UTF-8 text") from None
    lines = text.splitlines(keepends=True)
    at = next(
        (
            n
            for n, line in enumerate(lines)
            if line.strip() and not line.lstrip().startswith("#")
        ),
        None,
    )
    if at is None:
        return raw, []
    header = [cell.strip().lower() for cell in next(csv.reader([lines[at]]), [])]
    if "source" in header:
        return raw, _csv_items("".join(lines[at:]), path, first_line=at + 1)
    items = [
        {"source": line.strip()}
        for line in lines
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return raw, items


def _csv_items(text: str, path: str, first_line: int) -> list[dict]:
    rows = csv.reader(io.StringIO(text))
    header = [cell.strip() for cell in next(rows)]
    items = []
    for row in rows:
        number = first_line + rows.line_num - 1
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise Failure(
                f"{path}: line {number} has {len(row)} columns, "
                f"the header {len(header)}"
            )
        item: dict[str, Any] = {}
        params = {}
        for name, value in zip(header, row, strict=True):
            value = value.strip()
            if name.lower() == "source":
                item["source"] = value
            elif name.lower() == "duration_seconds":
                if value:
                    try:
                        item["duration_seconds"] = float(value)
                    except ValueError:
                        raise Failure(
                            f"{path}: line {number}: duration_seconds {value!r} is "
                            f"not a number"
                        ) from None
            elif value:
                params[name] = value
        if params:
            item["params"] = params
        items.append(item)
    return items


def requirements(pairs: list[str]) -> dict[str, str]:
    """``--require gpu=a100 --require model=large-v3`` as the batch's
    requirements. The form is checked here; the rules for keys and values are
    the server's (a 400 says which one is wrong)."""
    requires: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise Failure(f"--require {pair!r}: expected KEY=VALUE")
        if key in requires:
            raise Failure(f"--require: {key!r} is given twice")
        requires[key] = value
    return requires


def idempotency_key(manifest: bytes, name: str) -> str:
    digest = hashlib.sha256(name.encode("utf-8") + b"\0" + manifest).hexdigest()
    return f"recallctl-{digest[:40]}"


# --- Output ------------------------------------------------------------------------


def describe(batch: dict) -> str:
    counts = batch["counts"]
    parts = [
        f"batch {batch['id']} {batch['name']!r}: {batch['state']}",
        f"{counts['done']}/{batch['total']} done ({batch['percent_done']:g}%)",
    ]
    if counts["failed"]:
        parts.append(f"{counts['failed']} failed")
    if counts["cancelled"]:
        parts.append(f"{counts['cancelled']} cancelled")
    parts.append(f"{batch['in_flight']} in flight")
    if batch.get("silent"):
        parts.append(f"{batch['silent']} of them silent (no heartbeat)")
    retry = batch.get("retry")  # servers before issue 27 do not send it
    if retry and batch["state"] not in FINAL_STATES:
        # Nothing can be claimed until a backoff ends: that is what we wait for.
        parts.append(
            f"{retry['waiting']} waiting to retry in {_duration(retry['in_seconds'])}"
        )
    elif batch["state"] not in FINAL_STATES and batch["eta_seconds"] is not None:
        parts.append(f"ETA {_duration(batch['eta_seconds'])}")
    return ", ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def say(message: str) -> None:
    print(message, flush=True)


# --- Commands ----------------------------------------------------------------------


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    raw, items = read_manifest(args.manifest)
    if not items:
        raise Failure(f"{args.manifest} has no sources")
    name = args.name or ("stdin" if args.manifest == "-" else Path(args.manifest).stem)
    body: dict[str, Any] = {"name": name, "items": items}
    for option in ("priority", "weight", "max_in_flight"):
        value = getattr(args, option)
        if value is not None:
            body[option] = value
    if args.require:
        body["requires"] = requirements(args.require)
    key = args.idempotency_key or idempotency_key(raw, name)
    try:
        status, answer = client.json(
            "POST", "/api/v1/batches", body, {"Idempotency-Key": key}
        )
    except ApiError as error:
        if error.code == "bad_request" and "items[" in error.detail:
            raise Failure(f"the manifest was refused: {error.detail}") from None
        if error.code == "bad_request" and "requires" in error.detail:
            raise Failure(f"--require was refused: {error.detail}") from None
        if error.code == "idempotency_conflict":
            raise Failure(
                f"{error.detail} (this manifest and name were submitted before with "
                f"other options; pass --idempotency-key to submit it again)"
            ) from None
        raise
    batch = answer["batch"]
    if status == 201:
        say(f"submitted {describe(batch)}")
    else:
        say(f"already submitted (same manifest and name): {describe(batch)}")
    if args.wait:
        return wait_for(client, batch["id"], args.interval, args.timeout)
    say(str(batch["id"]))
    return EXIT_OK


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    _, batch = client.json("GET", f"/api/v1/batches/{args.id}")
    say(json.dumps(batch, indent=2) if args.json else describe(batch))
    return EXIT_OK


def cmd_wait(client: Client, args: argparse.Namespace) -> int:
    return wait_for(client, args.id, args.interval, args.timeout)


def wait_for(client: Client, batch_id: int, interval: float, timeout: float | None):
    """Print a progress line every ``interval`` seconds until the batch is final;
    a server that is briefly away (restart, 503) is waited for too."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            _, batch = client.json("GET", f"/api/v1/batches/{batch_id}")
        except ApiError as error:
            if error.status not in RETRY_STATUSES:
                raise
            say(f"batch {batch_id}: server busy ({error}); still waiting")
        except RedirectRefused:
            raise
        except Failure as error:  # the server is unreachable for now
            say(f"batch {batch_id}: {error}; still waiting")
        else:
            say(describe(batch))
            if batch["state"] == "cancelled":
                return EXIT_CANCELLED
            if batch["state"] == "finished":
                return EXIT_FAILED_ITEMS if batch["counts"]["failed"] else EXIT_OK
        if deadline is not None and time.monotonic() >= deadline:
            say(f"batch {batch_id}: --timeout ran out before it finished")
            return EXIT_TIMEOUT
        time.sleep(interval)


def cmd_export(client: Client, args: argparse.Namespace) -> int:
    path = f"/api/v1/batches/{args.id}/export.{args.format}"
    if args.output == "-":
        client.download(path, sys.stdout.buffer)
        return EXIT_OK
    target = Path(args.output)
    # Written beside the target and renamed: a cut download leaves no half file.
    fd, partial = tempfile.mkstemp(dir=target.parent or ".", prefix=".recallctl-")
    try:
        with os.fdopen(fd, "wb") as out:
            size = client.download(path, out)
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    say(f"wrote {target} ({size} bytes)")
    return EXIT_OK


def cmd_action(client: Client, args: argparse.Namespace) -> int:
    body = {}
    if args.command == "retry" and args.source_contains:
        body["source_contains"] = args.source_contains
    _, answer = client.json("POST", f"/api/v1/batches/{args.id}/{args.command}", body)
    note = {
        "cancel": f"cancelled {answer.get('cancelled', 0)} item(s)",
        "retry": f"queued {answer.get('queued', 0)} failed item(s) again",
        "pause": "paused" if answer["changed"] else "was already paused",
        "resume": "resumed" if answer["changed"] else "was not paused",
    }[args.command]
    say(f"{note}; {describe(answer['batch'])}")
    return EXIT_OK


# --- Command line --------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"recallctl: error: {message}\n")


def positive_id(value: str) -> int:
    # ASCII digits only: isdigit() also accepts '²' (which int() refuses) and
    # '١' (which int() reads as 1, another batch than the one meant).
    digits = value.isascii() and value.isdigit() and len(value) <= 19
    if not digits or not 0 < int(value) < 2**63:
        raise argparse.ArgumentTypeError(f"{value!r} is not a batch id")
    return int(value)


def build_parser() -> Parser:
    parser = Parser(
        prog="recallctl",
        description="Submit, follow and collect Recall batches "
        "(RECALL_URL, RECALL_API_TOKEN).",
    )
    parser.add_argument("--url", default=os.environ.get("RECALL_URL", ""))
    parser.add_argument(
        "--http-timeout", type=float, default=60, help="seconds per request"
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    def waiting(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--interval", type=float, default=5, help="seconds between progress lines"
        )
        sub.add_argument(
            "--timeout",
            type=float,
            default=None,
            help="give up after this many seconds",
        )

    submit = commands.add_parser("submit", help="submit a manifest as a batch")
    submit.add_argument("manifest", help="text or CSV manifest ('-': stdin)")
    submit.add_argument("--name", help="the batch's name (default: the file's)")
    submit.add_argument("--priority", type=int)
    submit.add_argument("--weight", type=int)
    submit.add_argument("--max-in-flight", type=int)
    submit.add_argument(
        "--require",
        action="append",
        metavar="KEY=VALUE",
        help="only workers offering this label may take the batch's jobs (repeatable)",
    )
    submit.add_argument("--idempotency-key", help="instead of the derived one")
    submit.add_argument("--wait", action="store_true", help="then wait for it")
    waiting(submit)

    status = commands.add_parser("status", help="one batch's progress")
    status.add_argument("id", type=positive_id)
    status.add_argument("--json", action="store_true", help="the whole object")

    wait = commands.add_parser("wait", help="wait until the batch is finished")
    wait.add_argument("id", type=positive_id)
    waiting(wait)

    export = commands.add_parser("export", help="download an export")
    export.add_argument("id", type=positive_id)
    export.add_argument("--format", choices=("csv", "jsonl", "zip"), required=True)
    export.add_argument("-o", "--output", required=True, help="file ('-': stdout)")

    for action, text in (
        ("cancel", "cancel the batch's queued and in-flight items"),
        ("retry", "queue the batch's failed items again"),
        ("pause", "hand out no new work from the batch"),
        ("resume", "hand out the batch's work again"),
    ):
        sub = commands.add_parser(action, help=text)
        sub.add_argument("id", type=positive_id)
        if action == "retry":
            sub.add_argument("--source-contains", help="only these sources")
    return parser


COMMANDS = {
    "submit": cmd_submit,
    "status": cmd_status,
    "wait": cmd_wait,
    "export": cmd_export,
    "cancel": cmd_action,
    "retry": cmd_action,
    "pause": cmd_action,
    "resume": cmd_action,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = os.environ.get("RECALL_API_TOKEN", "").strip()
    try:
        if not args.url:
            raise Failure("set RECALL_URL (or --url) to the Recall server's address")
        if not token:
            raise Failure("set RECALL_API_TOKEN to a personal API token")
        if warning := plain_http_warning(args.url):
            print(f"recallctl: warning: {warning}", file=sys.stderr)
        client = Client(args.url, token, timeout=args.http_timeout)
        return COMMANDS[args.command](client, args)
    except Failure as error:
        print(f"recallctl: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
