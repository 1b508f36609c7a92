#!/usr/bin/env bash
# `make run`: Recall on this machine, on the embedded SQLite default (or on
# DATABASE_URL if set): migrate, collect static files, start the django-q2
# cluster (the scheduled sweeper) and gunicorn (which reconciles at start-up).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p var

# Plain HTTP on localhost: secure cookies and the HTTPS redirect would lock you out.
export RECALL_HTTPS="${RECALL_HTTPS:-off}"
# On the embedded default (no DATABASE_URL), settings read var/secret_key
# themselves (creating it, mode 600), so `manage.py` in another terminal uses
# the same key. With another database, the key is passed on from here.
if [ -z "${SECRET_KEY:-}" ] && [ -n "${DATABASE_URL:-}" ]; then
    SECRET_KEY="$($PY -m recall_site.secret_key var/secret_key)"
    export SECRET_KEY
fi
export RECALL_BIND="${RECALL_BIND:-127.0.0.1:8000}"

$PY manage.py migrate --noinput -v0
$PY manage.py collectstatic --noinput -v0

# In a session of its own: it must get exactly one signal (a second one during
# shutdown can hang django-q2), and that one comes from stop() below.
setsid $PY manage.py qcluster &
QCLUSTER=$!
GUNICORN=""
stop() {
    kill -TERM $GUNICORN "$QCLUSTER" 2>/dev/null || true
    wait 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT TERM

echo
echo "Recall: http://$RECALL_BIND/   (Ctrl-C stops it)"
if ! $PY manage.py shell -v 0 -c "from django.contrib.auth.models import User; raise SystemExit(not User.objects.exists())" 2>/dev/null; then
    echo "No user yet: create one with   .venv/bin/python manage.py createsuperuser"
fi
echo
.venv/bin/gunicorn -c gunicorn.conf.py &
GUNICORN=$!
wait "$GUNICORN"
