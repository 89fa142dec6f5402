#!/usr/bin/env bash
# Run every benchmark and write its JSON into benchmarks/results/.
# Extra arguments (e.g. --ranks 4) go to every script. Each script is bounded by a timeout;
# a failing one does not stop the others, but makes this script exit non-zero.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
results="$here/results"
mkdir -p "$results"
python="${PYTHON:-python}"
status=0

for name in roundtrip start training failures logging; do
    echo
    timeout --kill-after=30 600 "$python" "$here/bench_$name.py" --json "$results/$name.json" "$@"
    code=$?
    if [ "$code" -ne 0 ]; then
        echo "bench_$name.py failed (exit status $code)" >&2
        status=1
    fi
done
exit "$status"
