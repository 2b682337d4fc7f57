#!/usr/bin/env bash
# The one-GPU check: correctness, speed and memory in one command (<= 8 minutes).
#
#   bash benchmarks/gpu/check.sh [OUT_DIR] [--smoke] [--only SECTION ...]
#
# Results: OUT_DIR/check.json and OUT_DIR/check.md (OUT_DIR defaults to $OUT, else
# ./out/gpu_check, which git ignores). See benchmarks/gpu/README.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$PWD/out/gpu_check}"
if [[ $# -gt 0 && "$1" != --* ]]; then
    out="$1"
    shift
fi
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# check.py stops starting sections at 470 s; this is the backstop for a hang in
# the driver itself, still inside the 8-minute budget.
timeout --kill-after=5 475 python benchmarks/gpu/check.py --out "$out" "$@"
status=$?
echo "[gpu check] exit status $status; summary: $out/check.md"
exit $status
