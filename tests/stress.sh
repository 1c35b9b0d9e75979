#!/usr/bin/env bash
# The Ray layer (tests/ray) under load, as a slow shared host runs it (issue 66):
#   tests/stress.sh hog       a busy loop on every core at nice 0 beside the tests
#   tests/stress.sh one-core  the tests (and every Ray process they start) pinned to core 0
#   tests/stress.sh           both, one after the other
# Extra arguments go to pytest (e.g. -k agents). Each mode prints its wall time and pytest's exit
# status; the script fails if any mode failed. Deadlines in the tests scale with
# RAYRLHF_TEST_TIMEOUT_SCALE (tests/helpers/timeouts.py); the default is meant to hold here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mode=${1:-both}
[ $# -gt 0 ] && shift
case "$mode" in hog | one-core | both) ;; *) echo "usage: tests/stress.sh [hog|one-core|both] [pytest args]" >&2; exit 2 ;; esac

hogs=()
stop_hogs() { [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null; hogs=(); }
trap stop_hogs EXIT

run_layer() {  # $1: the mode's name; the rest: a prefix for the pytest command (may be empty)
    local name=$1 start rc
    shift
    start=$(date +%s)
    "$@" "$PY" -m pytest -q tests/ray -p no:cacheprovider "${ARGS[@]}"
    rc=$?
    echo "[stress] $name: pytest exit $rc in $(($(date +%s) - start)) s"
    return $rc
}

ARGS=("$@")
failed=0
if [ "$mode" = hog ] || [ "$mode" = both ]; then
    for _ in $(seq "$(nproc)"); do
        nice -n 0 bash -c 'while :; do :; done' &
        hogs+=($!)
    done
    echo "[stress] hog: ${#hogs[@]} busy loops at nice 0"
    run_layer hog || failed=1
    stop_hogs
fi
if [ "$mode" = one-core ] || [ "$mode" = both ]; then
    echo "[stress] one-core: taskset -c 0"
    run_layer one-core taskset -c 0 || failed=1
fi
exit $failed
