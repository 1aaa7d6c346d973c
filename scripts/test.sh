#!/usr/bin/env bash
# Set up a virtual environment with the test extras and run the whole test suite.
# Used by the README and by CI (.ci/run). Exits non-zero if any test fails or if no test ran.
# `bash scripts/test.sh --quick`: the same without the longest files (tests/conftest.py's LONGEST_FIRST) and the
# `slow` tests and the model-comparison folders, for iterating (1352 tests, 4.7 minutes of pytest on 2 cores);
# other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--quick" ]; then
  shift
  export SDJAX_TEST_QUICK=1
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
# The web page's browser test drives Debian's Chromium; install it where we may (root + apt), else it is skipped.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium) \
    >/dev/null 2>&1 || echo "note: could not install chromium; the browser test will be skipped" >&2
fi
# Style is part of the suite: formatting and lint (ruff, from the test extra).
.venv/bin/python -m ruff format --check src tests benchmarks scripts
.venv/bin/python -m ruff check src tests benchmarks scripts
set +e
# --no-loadscope-reorder: hand files out in collection order (tests/conftest.py puts the longest first), not by
# their number of tests (xdist's default, which leaves the long one-test files for the end).
.venv/bin/python -m pytest -n "${SDJAX_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
