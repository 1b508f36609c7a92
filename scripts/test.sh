#!/usr/bin/env bash
# The test command behind `make test`.
#
# 1. Every test on PostgreSQL (TEST_DATABASE_URL; pytest-django creates and drops
#    a test_<name> database there), through the PostgreSQL statement backend.
# 2. The transition, API and state-machine tests (tests/jobs) again on PostgreSQL
#    through the portable ORM backend (RECALL_TRANSITIONS_BACKEND=orm).
# 3. The state-machine, API and intake tests again on the embedded SQLite default.
#
# If PostgreSQL is unreachable, step 1 is skipped with a warning, unless
# RECALL_REQUIRE_POSTGRES=1 (CI), which makes that an error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
# Settings refuse a weak key (under 50 characters) outside DEBUG: a fresh one.
export SECRET_KEY="${SECRET_KEY:-$($PY -c 'import secrets; print(secrets.token_urlsafe(50))')}"
# The test servers speak plain HTTP (production settings are checked separately,
# in tests/test_settings.py, with their HTTPS defaults).
export RECALL_HTTPS=off
export DJANGO_ALLOW_ASYNC_UNSAFE=true
TEST_DATABASE_URL="${TEST_DATABASE_URL:-postgres://root@127.0.0.1:5432/recall}"
mkdir -p var/static

if $PY scripts/db_reachable.py "$TEST_DATABASE_URL"; then
    echo "== tests on PostgreSQL"
    DATABASE_URL="$TEST_DATABASE_URL" $PY -m pytest "$@"
    echo "== transition, API and state-machine tests on PostgreSQL, ORM backend"
    DATABASE_URL="$TEST_DATABASE_URL" RECALL_TRANSITIONS_BACKEND=orm \
        $PY -m pytest tests/jobs "$@"
elif [ "${RECALL_REQUIRE_POSTGRES:-0}" = "1" ]; then
    echo "PostgreSQL is not reachable at $TEST_DATABASE_URL and RECALL_REQUIRE_POSTGRES=1." >&2
    exit 1
else
    echo "!! PostgreSQL is not reachable at $TEST_DATABASE_URL: skipping the PostgreSQL run." >&2
fi

echo "== tests on SQLite (the embedded default)"
DATABASE_URL="sqlite:///$PWD/var/test-run.sqlite3" \
SQLITE_TEST_NAME="$PWD/var/test.sqlite3" \
    $PY -m pytest -m "not postgres and not browser and not slow" "$@"
