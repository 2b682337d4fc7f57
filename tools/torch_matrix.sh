#!/usr/bin/env bash
# Runs the test suite against several torch releases, each in its own virtual
# environment, and prints one line per release. Not part of .ci/run (it downloads
# one torch build per release, and runs the whole suite once per release).
#
# Usage:
#   tools/torch_matrix.sh [-n] [DIR] [VERSION ...]
#
#   DIR      where the environments live (default: /tmp/fsdp_compose_matrix); each
#            release gets DIR/torch-VERSION, reused on later runs, and DIR/torch-VERSION.log
#   VERSION  torch releases to test (default: 2.11.0 2.13.0 2.15.0)
#   -n       print the commands instead of running them
#
# Environment:
#   TORCH_INDEX_URL  index to install torch from (default: pip's configured index;
#                    https://download.pytorch.org/whl/cpu gives the small CPU builds)
#   PYTEST_ARGS      what to run (default: "-q tests"); e.g. "-q tests/test_public_names.py"
#   PYTHON           interpreter for the environments (default: python3)
#
# A machine-wide pip constraint that caps torch (pip config list shows it) also
# applies inside the environments; to lift it for this script only, point
# PIP_CONSTRAINT at an empty file (an empty PIP_CONSTRAINT does not override it):
#   touch /tmp/no_constraints.txt; PIP_CONSTRAINT=/tmp/no_constraints.txt tools/torch_matrix.sh ...
# Exit status: 0 if every release passed, 1 otherwise.
set -uo pipefail

dry_run=0
if [[ "${1:-}" == "-n" ]]; then
    dry_run=1
    shift
fi
dir="${1:-/tmp/fsdp_compose_matrix}"
[[ $# -gt 0 ]] && shift
versions=("$@")
[[ ${#versions[@]} -eq 0 ]] && versions=(2.11.0 2.13.0 2.15.0)
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
pytest_args="${PYTEST_ARGS:--q tests}"
index_args=()
[[ -n "${TORCH_INDEX_URL:-}" ]] && index_args=(--index-url "$TORCH_INDEX_URL")

run() {
    if [[ $dry_run -eq 1 ]]; then
        echo "+ $*"
    else
        "$@"
    fi
}

declare -A result
failed=0
for version in "${versions[@]}"; do
    env_dir="$dir/torch-$version"
    log="$dir/torch-$version.log"
    out="$log"
    [[ $dry_run -eq 1 ]] && out=/dev/stdout
    run mkdir -p "$dir"
    echo "== torch $version: $env_dir (log: $log)"
    (
        set -e
        [[ -x "$env_dir/bin/python" ]] || run "$python" -m venv "$env_dir"
        run "$env_dir/bin/python" -m pip install -q "torch==$version" "${index_args[@]}"
        # The package and its test extra, without touching the torch just installed.
        run "$env_dir/bin/python" -m pip install -q -e "$repo[test]" "torch==$version" "${index_args[@]}"
        # shellcheck disable=SC2086 # PYTEST_ARGS is a list of arguments
        cd "$repo" && run env PYTHONPATH="$repo" "$env_dir/bin/python" -m pytest $pytest_args
    ) >"$out" 2>&1
    status=$?
    [[ $dry_run -eq 1 ]] || tail -n 3 "$log"
    if [[ $status -eq 0 ]]; then
        result[$version]="passed"
    else
        result[$version]="FAILED (exit $status)"
        failed=1
    fi
done

echo
echo "torch release | result"
for version in "${versions[@]}"; do
    echo "$version | ${result[$version]}"
done
exit $failed
