#!/usr/bin/env bash
# Services the test suite needs beyond the virtualenv, installed once per machine (idempotent).
#
# - PostgreSQL server binaries (Debian `postgresql`) for tests/reliability/test_scale_out.py,
#   which starts its own throwaway cluster on 127.0.0.1 (initdb into a temp dir). Nothing is
#   started here: Debian's default cluster is not created, so no server listens on 5432.
# - Redis server binaries (Debian `redis-server`) for the multi-host harness (tests/scaleout/),
#   which starts its own redis-server inside a network namespace. The package's service is kept
#   from starting while it installs (policy-rc.d), so nothing listens on 6379.
# - Chromium (Debian `chromium`, /usr/bin/chromium) for the UI check of tests/e2e/test_demo.py,
#   driven headless by playwright; that test fails when no browser is found.
# - bubblewrap (Debian `bubblewrap`, /usr/bin/bwrap), the default sandbox for model-written code
#   (pinned_eval/sandbox), and its unprivileged user `pe-sandbox` (no home, no shell), which a
#   root worker runs sandboxes as. The sandbox tests fail as root without them, skip otherwise.
#
# Without root (or apt-get) nothing is installed: the scale-out test skips with its reason and
# the UI test fails with the missing browser named; the multi-host harness skips, naming redis-server;
# the sandbox tests skip, naming bwrap.
set -euo pipefail

have_postgres() {
  command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1 && return 0
  compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null
}

have_chromium() {
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1
}

can_apt() {
  [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1
}

updated=0
apt_update() {
  if [[ $updated -eq 0 ]]; then
    apt-get update -qq
    updated=1
  fi
}

export DEBIAN_FRONTEND=noninteractive

if have_postgres; then
  echo "ci-services: PostgreSQL server binaries present"
elif ! can_apt; then
  echo "ci-services: PostgreSQL not installed and cannot apt-get here; the scale-out test will skip" >&2
else
  apt_update
  # postgresql-common first, so the default cluster (a server on 5432) is never created
  apt-get install -y -qq --no-install-recommends postgresql-common >/dev/null
  conf=/etc/postgresql-common/createcluster.conf
  if grep -qE '^\s*#?\s*create_main_cluster' "$conf"; then
    sed -i -E 's/^\s*#?\s*create_main_cluster.*/create_main_cluster = false/' "$conf"
  else
    echo 'create_main_cluster = false' >>"$conf"
  fi
  apt-get install -y -qq --no-install-recommends postgresql >/dev/null
  have_postgres && echo "ci-services: PostgreSQL installed: $(ls -d /usr/lib/postgresql/*/bin | tail -1)"
fi

if command -v redis-server >/dev/null 2>&1; then
  echo "ci-services: redis-server present: $(command -v redis-server)"
elif ! can_apt; then
  echo "ci-services: redis-server not installed and cannot apt-get here; the multi-host harness will skip" >&2
else
  apt_update
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
  fi
  apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  [[ $own_policy -eq 1 ]] && rm -f "$policy"
  command -v redis-server >/dev/null 2>&1 && echo "ci-services: redis-server installed: $(command -v redis-server)"
fi

if have_chromium; then
  echo "ci-services: Chromium present: $(command -v chromium || command -v chromium-browser)"
elif ! can_apt; then
  echo "ci-services: Chromium not installed and cannot apt-get here; the demo's UI test will fail" >&2
else
  apt_update
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
  have_chromium && echo "ci-services: Chromium installed: $(command -v chromium)"
fi

if command -v bwrap >/dev/null 2>&1; then
  echo "ci-services: bubblewrap present: $(command -v bwrap)"
elif ! can_apt; then
  echo "ci-services: bubblewrap not installed and cannot apt-get here; the sandbox tests will skip" >&2
else
  apt_update
  apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
  command -v bwrap >/dev/null 2>&1 && echo "ci-services: bubblewrap installed: $(command -v bwrap)"
fi

if [[ $(id -u) -eq 0 ]] && ! id pe-sandbox >/dev/null 2>&1; then
  useradd --system --no-create-home --shell /usr/sbin/nologin pe-sandbox
  echo "ci-services: created the sandbox user pe-sandbox"
fi
