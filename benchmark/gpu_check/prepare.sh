#!/usr/bin/env bash
# Run HERE, on the CPU machine, before `make gpu-check` on a lent GPU machine (benchmark/gpu_check/README.md).
#
# The GPU machine reaches no package registry, and one device call carries at most 64 MiB: the git working
# tree (tracked files and untracked files git does not ignore) plus the ignored paths named in `carry`.
# This script:
#   * downloads into .whl/ (git-ignored), unless already there:
#       - sglang==0.5.23 (--no-deps; ~39 MB: its Triton GDN kernels run there, its server cannot);
#       - pure-Python wheels of the test helpers a bare CUDA box may lack: pytest, hypothesis, einops and
#         their dependencies, with exceptiongroup and tomli for a Python 3.10 there (pip judges markers by
#         the Python running it), and setuptools + wheel for the offline editable install of the project
#         (a fresh venv's bundled setuptools may lack bdist_wheel); run.sh installs only those missing there;
#   * prints the wheels' sizes and fails, saying what to trim, when tree + .whl/ would exceed 64 MiB.
#
#   bash benchmark/gpu_check/prepare.sh [--check-only]     # --check-only: no downloads, size check only
# Env: PY (python with pip; default .venv/bin/python, else python3), GPU_CHECK_CARRY_LIMIT_MIB (default 64).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
LIMIT_MIB=${GPU_CHECK_CARRY_LIMIT_MIB:-64}
WHL=.whl
CHECK_ONLY=0
[ "${1:-}" = "--check-only" ] && CHECK_ONLY=1

if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

if [ "$CHECK_ONLY" = 0 ]; then
    mkdir -p "$WHL"
    if ls "$WHL"/sglang-0.5.23-*.whl > /dev/null 2>&1; then
        echo "sglang 0.5.23 wheel already in $WHL/"
    else
        echo "downloading sglang==0.5.23 (--no-deps) into $WHL/ ..."
        "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHL" sglang==0.5.23
    fi
    # Pure wheels (py3-none-any) for any Python >= 3.10 on the device: its interpreter is not known here.
    if ls "$WHL"/pytest-*.whl "$WHL"/hypothesis-*-none-any.whl "$WHL"/einops-*.whl "$WHL"/tomli-*.whl "$WHL"/wheel-*.whl > /dev/null 2>&1; then
        echo "test helper wheels already in $WHL/"
    else
        echo "downloading pure-Python pytest, hypothesis, einops (+ dependencies) into $WHL/ ..."
        "$PY" -m pip download -q --only-binary=:all: --platform any --implementation py --abi none \
            --python-version 3.10 -d "$WHL" pytest hypothesis einops exceptiongroup tomli setuptools wheel
    fi
fi

echo
echo "wheels in $WHL/:"
if ls "$WHL"/*.whl > /dev/null 2>&1; then
    for f in "$WHL"/*.whl; do
        printf '  %10s  %s\n' "$(mib "$(stat -c %s "$f")")" "$(basename "$f")"
    done
else
    echo "  (none)"
fi
if [ "$CHECK_ONLY" = 0 ] && ! ls "$WHL"/sglang-0.5.23-*.whl > /dev/null 2>&1; then
    echo "ERROR: no sglang-0.5.23 wheel in $WHL/ after the download" >&2
    exit 1
fi

# What one device call carries: tracked + untracked-not-ignored files of the work tree, .whl/, and shared/
# when the checkout has one there.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
    awk '{ s += $1 } END { print s + 0 }')
whl_bytes=0
[ -d "$WHL" ] && whl_bytes=$(find "$WHL" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
shared_bytes=0
[ -d shared ] && shared_bytes=$(find shared -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
total=$((tree_bytes + whl_bytes + shared_bytes))
limit=$((LIMIT_MIB * 1048576))

echo
echo "one device call carries (carry ['.whl']):"
printf '  %10s  work tree (tracked + untracked, not ignored)\n' "$(mib "$tree_bytes")"
printf '  %10s  .whl/\n' "$(mib "$whl_bytes")"
[ "$shared_bytes" -gt 0 ] && printf '  %10s  shared/\n' "$(mib "$shared_bytes")"
printf '  %10s  total, limit %s MiB\n' "$(mib "$total")" "$LIMIT_MIB"

if [ "$total" -gt "$limit" ]; then
    echo >&2
    echo "ERROR: the device call would carry $(mib "$total"), over its ${LIMIT_MIB} MiB limit." >&2
    echo "Largest files it would carry:" >&2
    { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c '%s %n' -- 2>/dev/null
      [ -d "$WHL" ] && find "$WHL" -type f -printf '%s %p\n'; } | sort -rn | sed -n '1,8p' |
        while read -r size name; do printf '  %10s  %s\n' "$(mib "$size")" "$name" >&2; done
    echo "Remove stray wheels from $WHL/ or large untracked files (or git-ignore them) and run this again." >&2
    exit 1
fi
echo "OK: under ${LIMIT_MIB} MiB. On the GPU machine: bash benchmark/gpu_check/run.sh (carry ['.whl'])."
