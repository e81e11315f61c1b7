#!/usr/bin/env bash
# Runs the whole hermes-env test suite on a fresh Debian machine, as root:
# installs and starts what the tests need (Docker engine, OpenSSH server,
# Apptainer), builds a venv from the project's declared dependencies only,
# tests the core with no plugin installed, then each plugin on its own.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export HERMES_ENV_TEST_ROOT=$ROOT
VENV=${HERMES_ENV_VENV:-$ROOT/.venv}
REPORTS=$(mktemp -d)
trap 'rm -rf "$REPORTS"' EXIT
# Stopped from outside: the lanes below go too.
trap 'trap - INT TERM; kill 0' INT TERM

step() { printf '\n=== %s\n' "$*"; }
die() { printf 'test.sh: %s\n' "$*" >&2; exit 1; }

step "system components"
bash scripts/ensure-docker.sh || die "could not start the Docker engine (see /var/log/hermes-dockerd.log)"
bash scripts/ensure-sshd.sh || die "could not install the OpenSSH server"
if [ -d plugins/hermes-env-singularity ]; then
    bash scripts/install-apptainer.sh || die "could not install apptainer"
fi

# The TypeScript MCP SDK client test (tests/mcp) needs node, npm and @modelcontextprotocol/sdk.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; } \
        || die "could not install nodejs and npm"
fi
(cd tests/mcp/ts && npm ci --no-audit --no-fund --loglevel=error) || die "npm ci in tests/mcp/ts failed"

# The Daytona emulator runs the default snapshot's commands in zsh, as the real daemon does.
if [ -d plugins/hermes-env-daytona ] && ! command -v zsh >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq zsh >/dev/null; } \
        || die "could not install zsh"
fi

# Two lanes, each in its own venv: the core's tests (with no plugin installed, so
# that they pass without one) and, beside them, every plugin, example and
# integration, each installed and tested alone in the other venv.
PLUGIN_VENV=${HERMES_ENV_PLUGIN_VENV:-$ROOT/.venv-plugins}
make_venv() {  # path
    local venv=$1
    step "python environment ($venv)"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || die "python3 -m venv $venv failed"
    fi
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    for p in hermes-env-daytona hermes-env-modal hermes-env-singularity hermes-env-example hermes-env-kubernetes hermes-env-inspect; do
        "$venv/bin/python" -m pip uninstall -q -y "$p" >/dev/null 2>&1 || true
    done
    "$venv/bin/python" -m pip install -q -e ".[docker,ssh,test,mcp,lint]" || die "pip install of the core into $venv failed"
}
make_venv "$VENV"
make_venv "$PLUGIN_VENV"
PY=$VENV/bin/python

status=0
run_suite() {  # python, name, then pytest arguments
    local py=$1 name=$2; shift 2
    step "tests: $name ($(date -u +%T))"
    timeout --signal=INT 1800 "$py" -m pytest -p no:cacheprovider --junitxml="$REPORTS/$name.xml" "$@"
    local rc=$?
    case $rc in
        0) ;;
        5) echo "test.sh: no tests were collected for $name"; return 1 ;;
        *) return 1 ;;
    esac
}

step "lint: ruff check (configuration in pyproject.toml)"
"$PY" -m ruff check hermes_env_core plugins || { echo "test.sh: ruff check failed"; status=1; }
# The core is typed strictly; the third-party example and the plugin template through public names only.
"$PY" -m mypy --strict hermes_env_core || { echo "test.sh: mypy --strict on the core failed"; status=1; }
"$PY" -m mypy --strict --follow-imports=silent examples/hermes-env-example/hermes_env_example examples/template \
    || { echo "test.sh: mypy --strict on the example or the template failed"; status=1; }

step "each backend's own logic lines (scripts/logic-lines.py)"
"$PY" scripts/logic-lines.py || status=1

core_lane() {
    local rc=0
    run_suite "$PY" core tests || rc=1
    # docker and ssh default to the session server; here the rest of their tests
    # run again through one process per command.
    HERMES_ENV_CHANNEL=0 run_suite "$PY" core-process \
        tests/backends/test_docker.py tests/backends/test_ssh.py tests/processes/test_bg_docker.py \
        tests/processes/test_bg_ssh.py -k "not Conformance" || rc=1
    return $rc
}

# Plugins, the third-party examples, then the integrations (inspect_ai's sandbox): each a distribution
# tested alone, with its [test] extra.
plugin_lane() {
    local rc=0 dir name py=$PLUGIN_VENV/bin/python
    for dir in plugins/*/ examples/*/ integrations/*/; do
        name=$(basename "$dir")
        [ -f "$dir/pyproject.toml" ] || { echo "test.sh: $dir has no pyproject.toml yet; not a distribution, skipped"; continue; }
        step "install $name"
        "$py" -m pip install -q -e "${dir%/}[test]" || { echo "test.sh: pip install of $name failed"; rc=1; continue; }
        run_suite "$py" "$name" "$dir/tests" --rootdir "$dir" || rc=1
        "$py" -m pip uninstall -q -y "$name" >/dev/null 2>&1 || true
    done
    return $rc
}

# The lanes run at once (~20 min instead of ~30), each one's output kept in its own log and
# printed whole once both are done. They share this host's /tmp and pid space (the Modal and
# Daytona emulators' sandboxes are host processes writing the same /tmp/hermes_t_* scratch
# names as the core's local tests), so no test may sweep /tmp by pattern or kill by name what
# it did not start: the Modal conformance failures once seen with the lanes at once were the
# core's ssh tests removing every /tmp/hermes_t_* on the host (fixed; it removes its own).
step "tests: two lanes from $(date -u +%T)"
core_lane >"$REPORTS/core.log" 2>&1 &
core_pid=$!
plugin_lane >"$REPORTS/plugins.log" 2>&1 &
plugin_pid=$!
wait "$core_pid" || status=1
wait "$plugin_pid" || status=1
cat "$REPORTS/core.log" "$REPORTS/plugins.log"
step "both lanes done at $(date -u +%T)"

step "summary"
"$PY" - "$REPORTS" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in sorted(glob.glob(sys.argv[1] + "/*.xml")):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for s in suites:
        for k in tot:
            tot[k] += int(s.get(k, 0))
        print(f"  {path.rsplit('/', 1)[-1][:-4]}: {s.get('tests')} tests, {s.get('failures')} failed, "
              f"{s.get('errors')} errors, {s.get('skipped')} skipped")
failed = tot["failures"] + tot["errors"]
passed = tot["tests"] - failed - tot["skipped"]
print(f"{passed} passed, {failed} failed, {tot['skipped']} skipped")
PY
exit $status
