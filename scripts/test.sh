#!/usr/bin/env bash
# The whole test suite on a fresh machine: Debian packages the tests need, PostgreSQL and
# Redis started if they are not running, the test database created, then lint, types, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PGHOST_ADDR=${PGHOST_ADDR:-127.0.0.1}
TEST_DB=${TEST_DB:-postroom_test}

log() { printf '\n== %s\n' "$*"; }

# Debian packages: the tests need a PostgreSQL server and client, a Redis server and Dovecot.
need_debs=()
command -v pg_ctlcluster >/dev/null || need_debs+=(postgresql)
command -v psql >/dev/null || need_debs+=(postgresql-client)
command -v redis-server >/dev/null || need_debs+=(redis-server)
# Browser tests drive Debian's Chromium with Playwright (never `playwright install`).
[ -x /usr/bin/chromium ] || need_debs+=(chromium)
# Bounce mailbox tests run their own Dovecot (tests/support/imap_server.py), never the system's.
{ [ -x /usr/sbin/dovecot ] && [ -x /usr/lib/dovecot/imap ]; } || need_debs+=(dovecot-core dovecot-imapd)
# deploy/'s alert rules are checked and unit-tested with promtool (Debian's prometheus package).
command -v promtool >/dev/null || need_debs+=(prometheus)
# The worker is tested through a local PgBouncer in transaction mode.
[ -x /usr/sbin/pgbouncer ] || need_debs+=(pgbouncer)
if [ ${#need_debs[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_debs[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debs[@]}"
fi

log "services"
if ! pg_isready -q -h "$PGHOST_ADDR" -p 5432; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start
  for _ in $(seq 1 30); do pg_isready -q -h "$PGHOST_ADDR" -p 5432 && break; sleep 1; done
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 30); do redis-cli ping >/dev/null 2>&1 && break; sleep 1; done
fi
if ! psql -h "$PGHOST_ADDR" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='$TEST_DB'" | grep -q 1; then
  echo "creating database $TEST_DB"
  psql -h "$PGHOST_ADDR" -U postgres -c "CREATE DATABASE $TEST_DB"
fi
export TEST_DATABASE_URL=${TEST_DATABASE_URL:-postgresql+psycopg://postgres@$PGHOST_ADDR:5432/$TEST_DB}
export TEST_PG_ADMIN_URL=${TEST_PG_ADMIN_URL:-postgresql+psycopg://postgres@$PGHOST_ADDR:5432/postgres}

log "python dependencies"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[dev]"

log "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

log "mypy"
.venv/bin/mypy

log "pytest"
mkdir -p test-output
.venv/bin/pytest "$@"
