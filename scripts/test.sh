#!/usr/bin/env bash
# The whole test suite on a fresh machine: Debian packages the tests need, PostgreSQL and
# Redis started if they are not running, the test database created, then lint, types, pytest.
#
#   scripts/test.sh [pytest args]         the whole suite, every tier (make test; CI)
#   scripts/test.sh --check [pytest args] lint, types, the unit and integration tiers (make check)
#
# pytest runs under pytest-xdist: the in-process tiers spread over every worker, and the
# process, browser and embedded tiers each keep to one worker of their own (xdist_group), so
# their waits overlap the others' CPU work. Each worker has its own database and Redis db.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=test
if [ "${1:-}" = "--check" ]; then
  MODE=check
  shift
fi

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
# The tiers run side by side (pytest-xdist), two of them with worker processes that each hold a
# pool of connections: 100, PostgreSQL's default, is too few.
if [ "$(psql -h "$PGHOST_ADDR" -U postgres -tAc 'SHOW max_connections')" -lt 400 ]; then
  echo "raising PostgreSQL's max_connections to 400"
  psql -h "$PGHOST_ADDR" -U postgres -qc "ALTER SYSTEM SET max_connections = 400"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main restart
  for _ in $(seq 1 30); do pg_isready -q -h "$PGHOST_ADDR" -p 5432 && break; sleep 1; done
fi
if ! psql -h "$PGHOST_ADDR" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='$TEST_DB'" | grep -q 1; then
  echo "creating database $TEST_DB"
  psql -h "$PGHOST_ADDR" -U postgres -c "CREATE DATABASE $TEST_DB"
fi
export TEST_DATABASE_URL=${TEST_DATABASE_URL:-postgresql+psycopg://postgres@$PGHOST_ADDR:5432/$TEST_DB}
export TEST_PG_ADMIN_URL=${TEST_PG_ADMIN_URL:-postgresql+psycopg://postgres@$PGHOST_ADDR:5432/postgres}

log "python dependencies"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# Installed again only when pyproject.toml changed since the last install. uv resolves the
# same newest versions pip would and installs them in about 10 s instead of about half a
# minute; it compiles the packages' bytecode as pip does (without it, every Python process
# the suite starts compiled flask, SQLAlchemy and the rest again: 4.6 s of CPU to build the
# app instead of 2.2, and the whole run a third slower). pip does it where uv cannot be had.
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
  if .venv/bin/python -m pip install --quiet uv && [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip install --quiet --compile-bytecode --python .venv/bin/python -e ".[dev]"
  else
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[dev]"
  fi
  touch .venv/.installed
fi

# The suite starts hundreds of Python processes (workers, their rq children, gunicorn, the
# run command): each reads the project's modules from bytecode written once, not compiled
# again, even where the environment asks Python not to write bytecode.
unset PYTHONDONTWRITEBYTECODE

log "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

# Types are checked while the tests run: mypy is one process, the tests use the other core's
# spare time, and its answer is waited for below.
log "mypy (in the background) and pytest"
mkdir -p test-output
.venv/bin/mypy > test-output/mypy.log 2>&1 &
MYPY_PID=$!

WORKERS=${TEST_WORKERS:-4}
status=0
if [ "$MODE" = check ]; then
  # Sweeps (generated examples, listed inputs) at a share of their full size: every test
  # still runs and asserts the same (tests/support/sweeps.py); make test runs them in full.
  # Four workers on two cores: some 160 of these tests spend most of their time waiting
  # (timeouts, backoffs, breakers; about 3 minutes in all), and with three workers the cores
  # sat idle a fifth of the run (55 of 260 core-seconds) against about 28 with four; in
  # turns, 3 runs each: 126-132 s with three, 115-119 s with four.
  POSTROOM_SWEEPS=${POSTROOM_SWEEPS:-quick} \
    .venv/bin/pytest -n "${CHECK_WORKERS:-4}" --dist loadgroup -m "unit or integration" "$@" \
    || status=$?
else
  # One rerun of a failed test: on 2 shared cores a test that times a shutdown or samples the
  # server's WAL can lose to the other workers' load. A test that fails twice fails the run,
  # and every rerun is listed in the summary ("R"): each is a test to make sturdier.
  .venv/bin/pytest -n "$WORKERS" --dist loadgroup --reruns 1 "$@" || status=$?
fi

log "mypy"
if ! wait "$MYPY_PID"; then
  cat test-output/mypy.log
  status=1
else
  tail -n 1 test-output/mypy.log
fi

exit "$status"
