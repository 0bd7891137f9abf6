#!/usr/bin/env bash
# HiState GPU check, run ON the lent GPU machine from the repository root (`make gpu-check`).
#
# The machine has CUDA torch, triton and transformers, no package registry, and gets the working tree
# plus .whl/ (made by benchmark/gpu_check/prepare.sh on the CPU machine). This script:
#   1. makes a venv with --system-site-packages (reusing the machine's torch/triton/transformers);
#   2. installs .whl/sglang-*.whl --no-deps (unpacking it when pip refuses its cp311 tag), the test helpers
#      the machine lacks (pytest, hypothesis, einops, from .whl/), and the project (-e python -e sgl-kernel-ext,
#      or a .pth when an offline editable install cannot build);
#   3. probes which import chains work (SGLang's server cannot run here: no sgl-kernel, no flashinfer);
#   4. runs (a) pytest -m gpu over the project's GPU tests and (b) capture_check.py, each with its own timeout
#      inside one overall budget (GPU_CHECK_BUDGET_S, default 450 s: the device allows 8 minutes);
#   5. prints ONE markdown table and writes it to $OUT/gpu_check.md ($OUT/gpu_check_logs/ holds the logs).
# Exit 0 when nothing failed. Never stops half-way: a failed step is a row, and later steps still run.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
HERE=benchmark/gpu_check
BUDGET=${GPU_CHECK_BUDGET_S:-450}
VENV=${GPU_CHECK_VENV:-/tmp/histate-gpu-venv}
WORK=$(mktemp -d /tmp/histate-gpu-check.XXXXXX)
if [ -n "${OUT:-}" ]; then LOGS=$OUT/gpu_check_logs; else LOGS=$WORK/logs; fi
mkdir -p "$LOGS"
STEPS=$WORK/steps.tsv
: > "$STEPS"
START=$SECONDS
# Offline: never let pip look for an index (it would retry for minutes).
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_WARN_SCRIPT_LOCATION=1
export PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false

one_line() { tr '\t\n' '  ' | sed 's/  */ /g; s/^ //; s/ $//' | cut -c1-400; }

record() {  # check result seconds detail
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | one_line)" >> "$STEPS"
    printf '[%3ds] %-26s %-8s %s\n' $((SECONDS - START)) "$1" "$2" "$(printf '%s' "$4" | one_line | cut -c1-160)"
}

# run_step CAP RESERVE LOG command... : runs with timeout min(CAP, time left - RESERVE - 15 s for the
# report); sets RC (124/137: timed out, 125: no time left) and DUR.
run_step() {
    local cap=$1 reserve=$2 log=$3
    shift 3
    local room=$((BUDGET - (SECONDS - START) - reserve - 15))
    LIMIT=$cap
    ((LIMIT > room)) && LIMIT=$room
    if ((LIMIT < 5)); then RC=125; DUR=0; echo "no time left in the ${BUDGET} s budget" > "$log"; return; fi
    local t0=$SECONDS
    timeout --kill-after=10 "$LIMIT" "$@" > "$log" 2>&1
    RC=$?
    DUR=$((SECONDS - t0))
}

timed_out() { [ "$RC" = 124 ] || [ "$RC" = 137 ]; }
tail_of() { grep -v '^\s*$' "$1" | tail -n "${2:-2}" | one_line; }

# --- 0. the machine ----------------------------------------------------------------------------------
PY=""
for cand in ${GPU_CHECK_PYTHON:-} python3 python; do
    command -v "$cand" > /dev/null 2>&1 || continue
    if "$cand" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' > /dev/null 2>&1; then
        PY=$cand
        break
    fi
done
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
if [ -z "$PY" ]; then
    record "machine" FAIL "" "no python with CUDA torch on PATH (tried ${GPU_CHECK_PYTHON:-} python3 python); GPU: ${GPU:-none seen by nvidia-smi}"
    PY=$(command -v python3 || command -v python)
    "$PY" $HERE/report.py --steps "$STEPS" --title "HiState GPU check" ${OUT:+--out "$OUT/gpu_check.md"}
    exit 1
fi
MACHINE=$("$PY" - 2>&1 <<'EOF'
import platform, torch
parts = [f"python {platform.python_version()}", f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
for name in ("triton", "transformers"):
    try:
        parts.append(f"{name} {__import__(name).__version__}")
    except Exception as err:
        parts.append(f"{name} MISSING ({type(err).__name__})")
print(", ".join(parts))
EOF
)
record "machine" info "" "${GPU:-GPU ?}; $MACHINE; $PY"

# --- 1. venv -----------------------------------------------------------------------------------------
t0=$SECONDS
VPY=$VENV/bin/python
if [ -x "$VPY" ] && "$VPY" -c 'import torch' > /dev/null 2>&1; then
    record "setup: venv" ok $((SECONDS - t0)) "reused $VENV"
else
    rm -rf "$VENV"
    if "$PY" -m venv --system-site-packages "$VENV" > "$LOGS/venv.log" 2>&1; then
        record "setup: venv" ok $((SECONDS - t0)) "$VENV (--system-site-packages)"
    elif rm -rf "$VENV" && "$PY" -m venv --system-site-packages --without-pip "$VENV" >> "$LOGS/venv.log" 2>&1; then
        record "setup: venv" ok $((SECONDS - t0)) "$VENV (--system-site-packages --without-pip: ensurepip unavailable; pip from the system)"
    else
        record "setup: venv" FAIL $((SECONDS - t0)) "python -m venv failed: $(tail_of "$LOGS/venv.log"); using $PY itself"
        VPY=$(command -v "$PY")
    fi
fi
PURELIB=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$VPY" -c 'import torch' > /dev/null 2>&1; then
    # $PY is itself a venv (--system-site-packages reaches its base interpreter, not its site-packages),
    # or torch sits in the user site, which a venv leaves out: add $PY's paths through a .pth
    "$PY" -c 'import site, sysconfig; print("\n".join(dict.fromkeys(site.getsitepackages() + [site.getusersitepackages()] + [sysconfig.get_paths()[k] for k in ("purelib", "platlib")])))' \
        > "$PURELIB/device-site.pth"
    if "$VPY" -c 'import torch' > /dev/null 2>&1; then
        record "setup: venv" info "" "torch not visible in the venv ($PY is a venv itself, or torch is in the user site): $PY's site-packages added through device-site.pth"
    else
        record "setup: venv" FAIL "" "torch does not import in $VENV even with $PY's site-packages on its path"
    fi
fi
HAS_PIP=1
"$VPY" -m pip --version > /dev/null 2>&1 || HAS_PIP=0

# --- 2. SGLang's wheel (--no-deps) ---------------------------------------------------------------------
t0=$SECONDS
shopt -s nullglob
WHEELS=(.whl/sglang-0.5.23-*.whl)
HELPER_WHEELS=(.whl/*-none-any.whl)
shopt -u nullglob
WHEEL=${WHEELS[0]:-}
if [ -z "$WHEEL" ]; then
    record "setup: sglang wheel" FAIL 0 "no .whl/sglang-0.5.23-*.whl: run benchmark/gpu_check/prepare.sh on the CPU machine and carry ['.whl']"
elif "$VPY" -c 'import importlib.metadata as m, sys; sys.exit(0 if m.version("sglang") == "0.5.23" else 1)' > /dev/null 2>&1; then
    record "setup: sglang wheel" ok $((SECONDS - t0)) "sglang 0.5.23 already installed"
else
    if [ "$HAS_PIP" = 1 ]; then
        run_step 120 240 "$LOGS/pip-sglang.log" "$VPY" -m pip install --no-deps --no-index "$WHEEL"
    else
        RC=1
        echo "no pip" > "$LOGS/pip-sglang.log"
    fi
    if [ "$RC" = 0 ]; then
        record "setup: sglang wheel" ok $((SECONDS - t0)) "pip install --no-deps $(basename "$WHEEL")"
    else
        why=$(grep -m1 -iE 'not a supported wheel|error' "$LOGS/pip-sglang.log" | one_line)
        if "$VPY" $HERE/unpack_wheel.py "$WHEEL" > "$LOGS/unpack-sglang.log" 2>&1; then
            record "setup: sglang wheel" ok $((SECONDS - t0)) "pip refused (${why:-see pip-sglang.log}); unpacked instead: $(tail_of "$LOGS/unpack-sglang.log" 1)"
        else
            record "setup: sglang wheel" FAIL $((SECONDS - t0)) "pip: ${why:-failed}; unpack: $(tail_of "$LOGS/unpack-sglang.log")"
        fi
    fi
fi

# --- 3. test helpers from .whl/ (only those the machine lacks) ------------------------------------------
t0=$SECONDS
MISSING=()
for mod in pytest hypothesis einops packaging; do
    "$VPY" -c "import $mod" > /dev/null 2>&1 || MISSING+=("$mod")
done
if [ ${#MISSING[@]} = 0 ]; then
    record "setup: helpers" ok $((SECONDS - t0)) "pytest, hypothesis, einops, packaging present"
else
    RC=1
    if [ "$HAS_PIP" = 1 ]; then
        run_step 60 240 "$LOGS/pip-helpers.log" "$VPY" -m pip install --no-index --find-links .whl "${MISSING[@]}"
    fi
    if [ "$RC" = 0 ]; then
        record "setup: helpers" ok $((SECONDS - t0)) "from .whl/: ${MISSING[*]}"
    else
        if [ ${#HELPER_WHEELS[@]} -gt 0 ] &&
            "$VPY" $HERE/unpack_wheel.py --if-missing "${HELPER_WHEELS[@]}" > "$LOGS/unpack-helpers.log" 2>&1; then
            still=()
            for mod in "${MISSING[@]}"; do "$VPY" -c "import $mod" > /dev/null 2>&1 || still+=("$mod"); done
            if [ ${#still[@]} = 0 ]; then
                record "setup: helpers" ok $((SECONDS - t0)) "unpacked from .whl/ (pip failed): ${MISSING[*]}"
            else
                record "setup: helpers" FAIL $((SECONDS - t0)) "still missing: ${still[*]} (prepare.sh puts them in .whl/)"
            fi
        else
            record "setup: helpers" FAIL $((SECONDS - t0)) "missing ${MISSING[*]} and no usable wheels in .whl/ (run prepare.sh)"
        fi
    fi
fi

# --- 4. the project ------------------------------------------------------------------------------------
t0=$SECONDS
RC=1
if [ "$HAS_PIP" = 1 ]; then
    # offline, so no build isolation: the venv's own setuptools builds, with wheel (both in .whl/ if missing)
    "$VPY" -m pip install -q --no-index --find-links .whl "setuptools>=64" wheel > "$LOGS/pip-build-deps.log" 2>&1
    run_step 90 240 "$LOGS/pip-project.log" "$VPY" -m pip install --no-deps --no-index --no-build-isolation -e python -e sgl-kernel-ext
fi
if [ "$RC" = 0 ]; then
    how="pip install --no-deps -e python -e sgl-kernel-ext"
else
    printf '%s\n' "$PWD/python" "$PWD/sgl-kernel-ext/python" > "$PURELIB/histate-gpu-check.pth"
    how="editable install failed ($(grep -m1 -iE 'error' "$LOGS/pip-project.log" 2>/dev/null | one_line | cut -c1-120)); source tree on sys.path via histate-gpu-check.pth"
fi
if "$VPY" -c 'import histate.sglang_plugin.capture_forward, histate_kernels' > "$LOGS/import-project.log" 2>&1; then
    record "setup: project" ok $((SECONDS - t0)) "$how"
else
    record "setup: project" FAIL $((SECONDS - t0)) "$how; import: $(tail_of "$LOGS/import-project.log" 1)"
fi

# --- 5. what imports here --------------------------------------------------------------------------------
run_step 60 240 "$LOGS/probe.log" "$VPY" $HERE/probe.py --tsv "$STEPS" --timeout 50
if [ "$RC" != 0 ]; then
    record "imports" info "$DUR" "probe did not finish (rc $RC): $(tail_of "$LOGS/probe.log")"
else
    printf '[%3ds] imports probed (%s s): see the table\n' $((SECONDS - START)) "$DUR"
fi

# --- 6a. the project's GPU tests -------------------------------------------------------------------------
GPU_TESTS=$(grep -rlE 'mark\.gpu' test --include='test_*.py' 2>/dev/null | sort | tr '\n' ' ')
[ -n "$GPU_TESTS" ] || GPU_TESTS="test/sglang/test_capture_gpu.py test/reference/test_kernels.py"
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths without spaces
run_step 150 200 "$LOGS/pytest.log" "$VPY" -m pytest -m gpu -q -rs $GPU_TESTS
summary=$(grep -E '(passed|failed|skipped|error|no tests ran)' "$LOGS/pytest.log" | tail -n 1 | sed 's/=//g' | one_line)
skips=$(grep -E '^SKIPPED' "$LOGS/pytest.log" | head -n 3 | sed 's/^SKIPPED \[[0-9]*\] //' | one_line)
if timed_out; then
    record "pytest -m gpu" timeout "$DUR" "over ${LIMIT} s; last: $(tail_of "$LOGS/pytest.log")"
elif [ "$RC" = 125 ]; then
    record "pytest -m gpu" skip 0 "no time left"
elif [ "$RC" = 0 ] && ! grep -q ' passed' <<< "$summary"; then
    record "pytest -m gpu" skip "$DUR" "$summary; ${skips}"
elif [ "$RC" = 0 ]; then
    record "pytest -m gpu" pass "$DUR" "$summary (${GPU_TESTS% })${skips:+; skipped: $skips}"
elif [ "$RC" = 5 ]; then
    record "pytest -m gpu" skip "$DUR" "no GPU test collected: $summary"
else
    record "pytest -m gpu" FAIL "$DUR" "rc $RC: $summary; $(grep -E '^(FAILED|ERROR)' "$LOGS/pytest.log" | head -n 3 | one_line)"
fi

# --- 6b. SGLang's Triton GDN kernel under HiState's capture ---------------------------------------------
CAPTURE_JSON=$WORK/capture.json
run_step 240 0 "$LOGS/capture_check.log" "$VPY" $HERE/capture_check.py --json "$CAPTURE_JSON"
case "$RC" in
    0) record "capture_check" pass "$DUR" "$(grep -E 'passed, .* failed' "$LOGS/capture_check.log" | tail -n 1)" ;;
    2) record "capture_check" skip "$DUR" "$(grep -E '\| skip \|' "$LOGS/capture_check.log" | head -n 1 | awk -F'|' '{print $7}')" ;;
    124 | 137) record "capture_check" timeout "$DUR" "over ${LIMIT} s; last: $(tail_of "$LOGS/capture_check.log")" ;;
    125) record "capture_check" skip 0 "no time left" ;;
    1) record "capture_check" FAIL "$DUR" "$(grep -E 'passed, .* failed' "$LOGS/capture_check.log" | tail -n 1)" ;;
    *) record "capture_check" FAIL "$DUR" "rc $RC: $(tail_of "$LOGS/capture_check.log" 3)" ;;
esac

# --- 7. the table -----------------------------------------------------------------------------------------
echo
REPORT_ARGS=(--steps "$STEPS" --title "HiState GPU check: ${GPU:-GPU}, $(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - START)) s")
[ -s "$CAPTURE_JSON" ] && REPORT_ARGS+=(--capture "$CAPTURE_JSON")
[ -n "${OUT:-}" ] && REPORT_ARGS+=(--out "$OUT/gpu_check.md")
"$VPY" $HERE/report.py "${REPORT_ARGS[@]}" || RC_REPORT=$?
[ -n "${OUT:-}" ] && echo "(written to $OUT/gpu_check.md; logs in $LOGS)"
exit "${RC_REPORT:-0}"
