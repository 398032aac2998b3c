#!/usr/bin/env bash
# The full suite: CI's test command (.ci/run) and the README's.
#
# Three parts, so that the machine's two cores stay busy without ever running two sets of
# gloo ranks at once:
#   1. the tests that spawn gloo ranks (marked `distributed`), one module after another;
#   2. beside them, in a second pytest process, every one-process test (the rule sweeps,
#      the planner, the compiler's one-process tests), which fills the time the ranks
#      spend waiting on each other; its output is printed when it ends;
#   3. then, alone, the tests marked `serial`: their ranks work under a short
#      process-group timeout that another test beside them could trip by starving a rank.
# Measured on 2026-12-06 (docs/testing.md#the-full-suite): two pytest-xdist workers, each
# running gloo modules, took longer than one process (42:24 against 40:44): two pools of
# ranks on two cores straggle in every collective.
#
#   bash tools/test_suite.sh              # everything, as CI runs it
#   bash tools/test_suite.sh -x -k gpt    # extra arguments go to every part
set -uo pipefail
cd "$(dirname "$0")/.."
one_process_log=$(mktemp)
trap 'rm -f "$one_process_log"' EXIT
python -m pytest -q -m "not distributed" "$@" tests >"$one_process_log" 2>&1 &
one_process=$!
python -m pytest -q -m "distributed and not serial" "$@" tests
gloo=$?
wait "$one_process"
single=$?
echo "================ the one-process tests (they ran beside the gloo tests)"
cat "$one_process_log"
python -m pytest -q -m serial "$@" tests
serial=$?
echo "exit codes: gloo tests $gloo, one-process tests $single, serial tests $serial"
# pytest's 5 ("no tests collected") is a failure here only when nothing ran at all,
# e.g. a -k that matches one part's tests alone
for rc in "$gloo" "$single" "$serial"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$gloo" -eq 5 ] && [ "$single" -eq 5 ] && [ "$serial" -eq 5 ]; then exit 5; fi
exit 0
