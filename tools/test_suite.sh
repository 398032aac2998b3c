#!/usr/bin/env bash
# The full suite: CI's test command (.ci/run) and the README's.
#
# Two parts. Most of the suite runs in SHARDC_TEST_WORKERS pytest processes at once
# (pytest-xdist, default 2, one per core here), a test module to a worker so that its
# cases share one pool of gloo ranks; tests/conftest.py hands the workers the modules with
# the most gloo cases first. Then the tests marked `serial` run alone: their ranks work
# under a short process-group timeout that a second test beside them could trip.
# Extra arguments go to both parts (e.g. -x, -k, --junitxml is not supported here).
set -uo pipefail
cd "$(dirname "$0")/.."
workers=${SHARDC_TEST_WORKERS:-2}
status=0
python -m pytest -q -n "$workers" --dist loadfile -m "not serial" "$@" tests || status=$?
python -m pytest -q -m serial "$@" tests || status=$((status ? status : $?))
exit "$status"
