"""Recall's settings: everything deployment-specific comes from the environment.

Every variable is documented in docs/reference/configuration.md. The defaults give a
one-machine set-up on an embedded SQLite file; production sets DATABASE_URL to
PostgreSQL, SECRET_KEY and ALLOWED_HOSTS.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import environ
from csp import constants as csp
from django.core.exceptions import ImproperlyConfigured

from . import logs, secret_key

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
if (BASE_DIR / ".env").is_file():
    environ.Env.read_env(BASE_DIR / ".env")

# Runtime files of the embedded set-up: SQLite database, collected static files.
VAR_DIR = Path(env.str("RECALL_VAR_DIR", default=str(BASE_DIR / "var")))

DEBUG = env.bool("DEBUG", default=False)

# The embedded set-up: no DATABASE_URL, so the SQLite file under var/. That is
# what `make run` serves, and every manage.py command on the same checkout must
# see the same database and the same key without exporting anything.
EMBEDDED = not env.str("DATABASE_URL", default="")

SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY and EMBEDDED:
    # Created on first use (mode 600), then shared by the server, the cluster
    # and every command; never used once DATABASE_URL points elsewhere.
    SECRET_KEY = secret_key.key_file(VAR_DIR / "secret_key")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "Set SECRET_KEY in the environment (or DEBUG=on for a throwaway "
            "development key). Without DATABASE_URL, Recall keeps one in "
            "var/secret_key."
        )
    SECRET_KEY = "django-insecure-recall-development-only"
if not DEBUG and (weakness := secret_key.weakness(SECRET_KEY)):
    raise ImproperlyConfigured(
        f"SECRET_KEY is too weak: {weakness}. Generate one with: python3 -c "
        f"'import secrets; print(secrets.token_urlsafe(50))'"
    )
# Earlier keys, comma-separated, newest first: they still verify what they
# signed (sessions, password reset links) and decrypt webhook secrets
# (jobs/webhook_keys.py), while everything new uses SECRET_KEY. Each is held to
# SECRET_KEY's rules: a weak fallback is as good as a weak key to an attacker.
SECRET_KEY_FALLBACKS = [
    key.strip()
    for key in env.str("SECRET_KEY_FALLBACKS", default="").split(",")
    if key.strip()
]
for _number, _fallback in enumerate(SECRET_KEY_FALLBACKS, start=1):
    if not DEBUG and (weakness := secret_key.weakness(_fallback)):
        raise ImproperlyConfigured(
            f"SECRET_KEY_FALLBACKS: key {_number} of {len(SECRET_KEY_FALLBACKS)} "
            f"is too weak: {weakness}. Keys are separated by commas."
        )

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django_q",
    "axes",
    "csp",
    "batches",
    "jobs",
    "operator_api",
    "engine",
    "api",
    "console",
]

MIDDLEWARE = [
    "recall_site.middleware.ReleaseBodyMiddleware",
    "recall_site.middleware.HealthCheckMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # The content security policy, static files, sessions, the logged-in
    # user and flash messages serve the pages: the worker API's requests
    # pass them by (recall_site/middleware.py, PagesOnly).
    "recall_site.middleware.ContentSecurityPolicyMiddleware",
    "recall_site.middleware.StaticFilesMiddleware",
    "recall_site.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "recall_site.middleware.AuthenticationMiddleware",
    "recall_site.middleware.SessionIdleMiddleware",
    "recall_site.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "recall_site.middleware.DatabaseUnavailableMiddleware",
    # Last, as django-axes asks: turns a locked-out login into its 429 page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "recall_site.urls"
WSGI_APPLICATION = "recall_site.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -----------------------------------------------------------------
# The embedded default is a SQLite file in WAL mode. Every transaction starts with
# BEGIN IMMEDIATE, so writers are serialised by SQLite's own lock and Recall's
# compare-and-set transitions stay correct with several processes (gunicorn
# workers plus the django-q2 cluster). select_for_update() is a no-op there.
DEFAULT_SQLITE_URL = f"sqlite:///{VAR_DIR / 'recall.sqlite3'}"
DATABASES = {"default": env.db_url("DATABASE_URL", default=DEFAULT_SQLITE_URL)}
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# Each thread keeps its own persistent connection (gunicorn's threads live as
# long as their process): processes x threads connections per web server. Not a
# pool: after a database restart psycopg-pool waits out an exponential backoff
# before it reconnects, and answers 503 meanwhile; a thread's own connection is
# health-checked and reopened by its next request: by a look at its socket,
# not a round trip (recall_site/postgresql/base.py).
RECALL_WEB_THREADS = env.int("RECALL_WEB_THREADS", default=1)
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["ENGINE"] = "recall_site.postgresql"
    connect_timeout = env.int("DATABASE_CONNECT_TIMEOUT", default=5)
    # Fail fast while the server is down: requests answer 503 instead of hanging.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
        "connect_timeout", connect_timeout
    )
    # Server-side cursors (QuerySet.iterator(), used by the background intake)
    # live in one transaction's connection, which PgBouncer's transaction
    # pooling does not keep: Django's documentation asks to turn them off there.
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = env.bool(
        "DATABASE_DISABLE_SERVER_SIDE_CURSORS", default=False
    )
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "transaction_mode": "IMMEDIATE",
            "timeout": env.int("SQLITE_BUSY_TIMEOUT", default=20),
            "init_command": (
                "PRAGMA journal_mode=WAL;PRAGMA synchronous=NORMAL;"
                "PRAGMA foreign_keys=ON"
            ),
        }
    )
    DATABASES["default"]["TEST"] = {
        "NAME": env.str("SQLITE_TEST_NAME", default=str(VAR_DIR / "test.sqlite3"))
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": f"django.contrib.auth.password_validation.{name}"}
    for name in (
        "UserAttributeSimilarityValidator",
        "MinimumLengthValidator",
        "CommonPasswordValidator",
        "NumericPasswordValidator",
    )
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = env.str("TIME_ZONE", default="UTC")
USE_I18N = True
USE_TZ = True
# Times with seconds in the admin (leases last seconds): recall_site/formats/.
FORMAT_MODULE_PATH = ["recall_site.formats"]

# --- Login throttling (django-axes; recall_site/auth.py) ------------------------
# After RECALL_LOGIN_FAILURE_LIMIT failed logins, a username is locked out from
# the address that failed (other users, and the same user elsewhere, are not)
# for RECALL_LOGIN_LOCKOUT_MINUTES; an admin unlocks sooner by deleting its
# access attempts (Admin, Axes). The login page and the admin's alike.
AUTHENTICATION_BACKENDS = [
    "recall_site.auth.LoginThrottleBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env.int("RECALL_LOGIN_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(
    minutes=env.int("RECALL_LOGIN_LOCKOUT_MINUTES", default=15)
)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = "recall_site.auth.client_ip"
AXES_USERNAME_CALLABLE = "recall_site.auth.username"
AXES_LOCKOUT_CALLABLE = "recall_site.auth.locked_out"
AXES_VERBOSE = False

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "overview"
LOGOUT_REDIRECT_URL = "login"

# --- Static files (whitenoise, hashed names) ----------------------------------
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}

# --- Request size -------------------------------------------------------------
# The worker API reads bodies through request.body, so this is its size limit
# (413 payload_too_large above it). It must hold a long transcript with timed
# segments.
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("RECALL_MAX_BODY_BYTES", default=10 * 1024 * 1024)

# --- HTTPS and security headers -----------------------------------------------
# On by default outside DEBUG, so `manage.py check --deploy` is clean. `make run`
# turns it off because it serves plain HTTP on localhost.
RECALL_HTTPS = env.bool("RECALL_HTTPS", default=not DEBUG)
SECURE_SSL_REDIRECT = RECALL_HTTPS
SESSION_COOKIE_SECURE = RECALL_HTTPS
CSRF_COOKIE_SECURE = RECALL_HTTPS
SECURE_HSTS_SECONDS = env.int(
    "SECURE_HSTS_SECONDS", default=31536000 if RECALL_HTTPS else 0
)
# HSTS for Recall's own host only, unless asked: includeSubDomains would force
# HTTPS on every sibling under the same domain (an intranet page on plain HTTP
# included), and preload asks browsers' lists for that, for a long time. Both
# are commitments for the domain's owner, not for one application.
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool(
    "SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False
)
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
# `check --deploy` warns about each of them off: they are off on purpose.
SILENCED_SYSTEM_CHECKS = [
    *([] if SECURE_HSTS_INCLUDE_SUBDOMAINS else ["security.W005"]),
    *([] if SECURE_HSTS_PRELOAD else ["security.W021"]),
]
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
# Behind a TLS-terminating reverse proxy: trust its X-Forwarded-Proto, and take
# the client's address from the X-Forwarded-For entry it appended (login
# throttling counts failures per address).
RECALL_BEHIND_PROXY = env.bool("RECALL_BEHIND_PROXY", default=False)
if RECALL_BEHIND_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
# A login ends after this long without a request (sliding: every page or
# action moves it on, at most once a minute; the pages' own refreshes do not,
# so a forgotten tab does not keep a session alive). recall_site/middleware.py
RECALL_SESSION_IDLE_SECONDS = env.int("RECALL_SESSION_IDLE_SECONDS", default=8 * 3600)
if RECALL_SESSION_IDLE_SECONDS < 60:
    raise ImproperlyConfigured("RECALL_SESSION_IDLE_SECONDS must be at least 60.")
SESSION_COOKIE_AGE = RECALL_SESSION_IDLE_SECONDS
SESSION_ENGINE = "recall_site.sessions"  # the database's, knowing its expiry

# Content-Security-Policy (django-csp): scripts and styles only from Recall's own
# static files, never inline (the progress bars are SVG geometry, not style
# attributes), so injected markup can neither run nor restyle anything. The
# worker API answers JSON to programs: no policy there.
CONTENT_SECURITY_POLICY = {
    "EXCLUDE_URL_PREFIXES": ["/api/"],
    "DIRECTIVES": {
        "default-src": [csp.SELF],
        "script-src": [csp.SELF],
        "style-src": [csp.SELF],
        "img-src": [csp.SELF],
        "connect-src": [csp.SELF],
        "form-action": [csp.SELF],
        "frame-ancestors": [csp.NONE],
        "base-uri": [csp.NONE],
        "object-src": [csp.NONE],
    },
}

# --- Recall -------------------------------------------------------------------
# Which backend writes the transitions (jobs/transitions): "auto" takes the
# PostgreSQL statement backend on PostgreSQL and the ORM backend elsewhere; "orm"
# forces the portable ORM backend everywhere (the tests run both).
RECALL_TRANSITIONS_BACKEND = env.str("RECALL_TRANSITIONS_BACKEND", default="auto")
if RECALL_TRANSITIONS_BACKEND not in ("auto", "orm"):
    raise ImproperlyConfigured("RECALL_TRANSITIONS_BACKEND must be auto or orm.")
# PostgreSQL: prepare the claim's and completion's statements once per connection
# (jobs/transitions/backends/statements.py). Turn off behind a pooler that cannot keep
# prepared statements (PgBouncer in transaction mode before 1.21).
RECALL_PREPARED_STATEMENTS = env.bool("RECALL_PREPARED_STATEMENTS", default=True)
RECALL_LEASE_SECONDS = env.int("RECALL_LEASE_SECONDS", default=60)
RECALL_MAX_ATTEMPTS = env.int("RECALL_MAX_ATTEMPTS", default=3)
RECALL_RETRY_BACKOFF_SECONDS = env.int("RECALL_RETRY_BACKOFF_SECONDS", default=30)
# Longest retry delay, whatever the attempt number.
RECALL_RETRY_BACKOFF_MAX_SECONDS = env.int(
    "RECALL_RETRY_BACKOFF_MAX_SECONDS", default=3600
)
# Quality flags: a completed transcript of audio at least 30 s long (known
# duration) with fewer words per minute than this is flagged "short" (batches/flags.py).
RECALL_MIN_WORDS_PER_MINUTE = env.int("RECALL_MIN_WORDS_PER_MINUTE", default=20)
# Live leases one worker (one token) may hold: a claim beyond it answers 429, so a
# leaked token cannot drain the queue into leases that then expire.
RECALL_MAX_LEASES_PER_WORKER = env.int("RECALL_MAX_LEASES_PER_WORKER", default=32)
# Long-poll claims one worker may have waiting on the whole server (all its
# gunicorn processes): one more answers at once, as with wait_seconds 0, so one
# token cannot fill the server's connections with parked claims. 0: none waits.
RECALL_MAX_WAITING_CLAIMS_PER_WORKER = env.int(
    "RECALL_MAX_WAITING_CLAIMS_PER_WORKER", default=4
)
# Worker API requests one worker may make per second on the whole server (a
# token bucket holding RECALL_WORKER_RATE_BURST); beyond, 429 rate_limited with
# Retry-After. The default leaves room for a worker at its 32-lease cap that
# heartbeats each lease every second and claims and completes as often. 0: off.
try:
    RECALL_WORKER_RATE_PER_SECOND = float(
        env.str("RECALL_WORKER_RATE_PER_SECOND", default="100")
    )
except ValueError:
    RECALL_WORKER_RATE_PER_SECOND = float("nan")  # refused below
RECALL_WORKER_RATE_BURST = env.int("RECALL_WORKER_RATE_BURST", default=200)
# Long-poll claims: how often the server (its processes share one answer) asks
# the database whether a parked claim may find work, while any waits
# (recall_site/gunicorn_worker.py).
RECALL_LONG_POLL_PROBE_SECONDS = env.float(
    "RECALL_LONG_POLL_PROBE_SECONDS", default=0.25
)
# Slow clients (recall_site/gunicorn_worker.py): a request's head must arrive
# within this many seconds of its first byte (of the connection's opening for
# the first), and a body may never stop for this long, or the server answers
# 408 and drops it. No request takes a thread before it has arrived whole.
RECALL_CLIENT_TIMEOUT_SECONDS = env.float("RECALL_CLIENT_TIMEOUT_SECONDS", default=10)
# How many expired leases one claim reclaims before it looks for work.
RECALL_RECLAIM_ON_CLAIM = env.int("RECALL_RECLAIM_ON_CLAIM", default=100)
# Rows per transaction in the sweep and in bulk operations: keeps locks short.
RECALL_CHUNK_SIZE = env.int("RECALL_CHUNK_SIZE", default=500)
# Jobs the sweep's rotating consistency scan checks per pass (0: the whole table).
RECALL_RECONCILE_SCAN_PER_SWEEP = env.int(
    "RECALL_RECONCILE_SCAN_PER_SWEEP", default=200_000
)
# A batch with items in flight but no completion or heartbeat for this long is
# shown as stalled.
RECALL_STALLED_AFTER_SECONDS = env.int(
    "RECALL_STALLED_AFTER_SECONDS", default=max(180, 3 * RECALL_LEASE_SECONDS)
)
# Per-minute throughput history kept for charts and ETAs.
RECALL_THROUGHPUT_RETENTION_HOURS = env.int(
    "RECALL_THROUGHPUT_RETENTION_HOURS", default=48
)
# Retention (docs/guides/retention.md): when set, each sweep deletes batches finished
# more than this many days ago, at most RECALL_RETENTION_PURGE_PER_SWEEP jobs a
# pass. Unset (the default): nothing is ever deleted but by recall_purge.
_retention = env.str("RECALL_RETENTION_DAYS", default="").strip()
try:
    RECALL_RETENTION_DAYS = float(_retention) if _retention else None
except ValueError:
    RECALL_RETENTION_DAYS = float("nan")
if RECALL_RETENTION_DAYS is not None and not 0 <= RECALL_RETENTION_DAYS < 36500:
    raise ImproperlyConfigured(
        "RECALL_RETENTION_DAYS must be a number of days from 0 (or empty: off)."
    )
RECALL_RETENTION_PURGE_PER_SWEEP = env.int(
    "RECALL_RETENTION_PURGE_PER_SWEEP", default=10_000
)
# /readyz fails when the last sweep finished longer ago than this.
RECALL_READY_MAX_SWEEP_AGE_SECONDS = env.int(
    "RECALL_READY_MAX_SWEEP_AGE_SECONDS", default=300
)
# Largest manifest file the web form accepts (the command has no byte limit).
RECALL_MAX_MANIFEST_BYTES = env.int(
    "RECALL_MAX_MANIFEST_BYTES", default=100 * 1024 * 1024
)
# Manifest files larger than this are taken in by the django-q2 cluster in the
# background (the page shows its progress); smaller ones within the request.
RECALL_BACKGROUND_INTAKE_BYTES = env.int(
    "RECALL_BACKGROUND_INTAKE_BYTES", default=1024 * 1024
)
# Exports one web process streams at once (0: no limit); a further one gets a
# 503 "try again" page. A process that listens only while it has a free thread
# (gunicorn.conf.py) already sends heartbeats past busy processes; this limit
# also keeps threads free when every process is busy, at the price of refusing
# an export that lands on a process already streaming that many.
RECALL_EXPORTS_PER_PROCESS = env.int("RECALL_EXPORTS_PER_PROCESS", default=0)
# /metrics answers only when this is set, and only to "Authorization: Bearer <it>".
# It crosses the network on every scrape (often over plain HTTP, node by node),
# and anyone who guesses it reads the fleet: held to a minimum like SECRET_KEY.
RECALL_METRICS_TOKEN = env.str("RECALL_METRICS_TOKEN", default="")
METRICS_TOKEN_MIN_LENGTH = 32
if RECALL_METRICS_TOKEN and (
    len(RECALL_METRICS_TOKEN) < METRICS_TOKEN_MIN_LENGTH
    or len(set(RECALL_METRICS_TOKEN)) < secret_key.MIN_UNIQUE_CHARACTERS
):
    raise ImproperlyConfigured(
        f"RECALL_METRICS_TOKEN is too weak: it has {len(RECALL_METRICS_TOKEN)} "
        f"characters ({len(set(RECALL_METRICS_TOKEN))} different); at least "
        f"{METRICS_TOKEN_MIN_LENGTH} ({secret_key.MIN_UNIQUE_CHARACTERS} different) "
        f"are needed. Generate one with: python3 -c "
        f"'import secrets; print(secrets.token_urlsafe(32))'"
    )
# Largest manifest accepted (items).
RECALL_MAX_MANIFEST_ITEMS = env.int("RECALL_MAX_MANIFEST_ITEMS", default=1_000_000)
# URL schemes a source may have (plain paths, absolute or relative, are always
# allowed); intake refuses any other (ftp:, data:, javascript: ...).
RECALL_SOURCE_SCHEMES = [
    scheme.strip().lower().removesuffix(":")
    for scheme in env.list(
        "RECALL_SOURCE_SCHEMES", default=["s3", "gs", "az", "http", "https", "file"]
    )
    if scheme.strip()
]

# --- Webhooks (engine/webhooks/; docs/guides/webhooks.md) ---
# Seconds to wait before each retry of a failed delivery (the Standard Webhooks
# schedule by default): the first attempt is immediate, then one per delay.
RECALL_WEBHOOK_RETRY_SECONDS = env.list(
    "RECALL_WEBHOOK_RETRY_SECONDS",
    cast=int,
    default=[5, 300, 1800, 7200, 18000, 36000, 36000],
)
# A delivery attempt succeeds with a 2xx within this many seconds (in all).
RECALL_WEBHOOK_TIMEOUT_SECONDS = env.int("RECALL_WEBHOOK_TIMEOUT_SECONDS", default=15)
# Loopback and private networks as destinations (link-local and cloud metadata
# addresses are refused whatever this says).
RECALL_WEBHOOK_ALLOW_PRIVATE = env.bool("RECALL_WEBHOOK_ALLOW_PRIVATE", default=False)
# After a secret is rotated, the old one is still signed with for this long.
RECALL_WEBHOOK_ROTATION_HOURS = env.int("RECALL_WEBHOOK_ROTATION_HOURS", default=24)
# Recall's public address, for the links in webhook payloads (e.g.
# https://recall.example.com); without it they are paths.
RECALL_PUBLIC_URL = env.str("RECALL_PUBLIC_URL", default="").rstrip("/")
if any(delay < 0 for delay in RECALL_WEBHOOK_RETRY_SECONDS):
    raise ImproperlyConfigured("RECALL_WEBHOOK_RETRY_SECONDS must not be negative.")
if RECALL_WEBHOOK_TIMEOUT_SECONDS < 1 or RECALL_WEBHOOK_ROTATION_HOURS < 0:
    raise ImproperlyConfigured(
        "RECALL_WEBHOOK_TIMEOUT_SECONDS must be at least 1, and "
        "RECALL_WEBHOOK_ROTATION_HOURS not negative."
    )

for _name in (
    "RECALL_LEASE_SECONDS",
    "RECALL_MAX_ATTEMPTS",
    "RECALL_CHUNK_SIZE",
    "RECALL_MAX_LEASES_PER_WORKER",
    "RECALL_RETENTION_PURGE_PER_SWEEP",
):
    if globals()[_name] < 1:
        raise ImproperlyConfigured(f"{_name} must be at least 1.")
if RECALL_RETRY_BACKOFF_SECONDS < 0:
    raise ImproperlyConfigured("RECALL_RETRY_BACKOFF_SECONDS must not be negative.")
if RECALL_MIN_WORDS_PER_MINUTE < 0:
    raise ImproperlyConfigured("RECALL_MIN_WORDS_PER_MINUTE must not be negative.")
if RECALL_MAX_WAITING_CLAIMS_PER_WORKER < 0:
    raise ImproperlyConfigured(
        "RECALL_MAX_WAITING_CLAIMS_PER_WORKER must not be negative."
    )
if not (0 <= RECALL_WORKER_RATE_PER_SECOND < float("inf")):
    raise ImproperlyConfigured(
        "RECALL_WORKER_RATE_PER_SECOND must be a number of requests, 0 or more."
    )
if not 1 <= RECALL_WORKER_RATE_BURST <= 1_000_000:
    raise ImproperlyConfigured("RECALL_WORKER_RATE_BURST must be 1 to 1,000,000.")
if not 0 < RECALL_CLIENT_TIMEOUT_SECONDS <= 3600:
    raise ImproperlyConfigured(
        "RECALL_CLIENT_TIMEOUT_SECONDS must be above 0 and at most 3600."
    )
if not 0 < RECALL_LONG_POLL_PROBE_SECONDS <= 10:
    raise ImproperlyConfigured(
        "RECALL_LONG_POLL_PROBE_SECONDS must be above 0 and at most 10."
    )

# --- django-q2 (the scheduled sweeper) ----------------------------------------
# The ORM broker on Recall's own database is the default; set RECALL_Q_REDIS_URL to
# use Redis instead. catch_up is off: a missed sweep is not worth replaying.
Q_CLUSTER = {
    "name": "recall",
    # Two: a minute-long background intake never delays the minute's sweep.
    "workers": env.int("RECALL_Q_WORKERS", default=2),
    "timeout": 240,
    "retry": 300,
    "max_attempts": 1,
    "catch_up": False,
    "save_limit": 100,
    "ack_failures": True,
    "poll": 1,
}
if _redis_url := env.str("RECALL_Q_REDIS_URL", default=""):
    Q_CLUSTER["redis"] = _redis_url
else:
    Q_CLUSTER["orm"] = "default"

# --- Logs -----------------------------------------------------------------------
# text: lines on stderr (the default); json: one JSON object per line on stdout,
# with the job, attempt, worker and batch ids a record carries (recall_site/logs.py).
# gunicorn.conf.py reads the same two variables for gunicorn's own logs.
LOG_FORMAT = env.str("LOG_FORMAT", default="text")
if LOG_FORMAT not in logs.FORMATS:
    raise ImproperlyConfigured(f"LOG_FORMAT must be one of {', '.join(logs.FORMATS)}.")
LOGGING = logs.django_logging(LOG_FORMAT, env.str("LOG_LEVEL", default="INFO"))
# django-axes logs every login at INFO; lockouts are WARNING.
LOGGING["loggers"]["axes"] = {"level": "WARNING"}
