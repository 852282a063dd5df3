#!/usr/bin/env bash
# The newcomer check: what a new user does after `git clone`, verified end to end.
#
# Clones the committed HEAD of this checkout (not the working tree) into an empty temp dir and, in a fresh environment
# (the clone's own .venv, created by the command itself; an empty PDSERVE_CACHE_DIR and HF_HOME; no inherited venv,
# PYTHONPATH or PDSERVE_* settings), runs the README Quickstart's first command exactly as written (`make up`) in its
# own process group on the README's port 8080. It waits for the printed OpenAI base URL, sends one chat completion with
# the official `openai` client, stops the command with SIGINT to its process group (what Ctrl-C does) and checks that
# nothing is left running: no process whose cwd or command line is inside the clone, nothing listening on 8080 or on
# the pods' ports. Prints `newcomer check: PASS|FAIL ...` last; exits non-zero on failure; always cleans up.
#
# pip's download cache (~/.cache/pip, where pip keeps one) is reused on purpose: it holds wheels as downloaded from
# PyPI, not an installed environment, and a cold download of torch would only measure the network.
#
# Usage: scripts/newcomer-check.sh   (env: NEWCOMER_START_TIMEOUT=1500 s, NEWCOMER_STOP_TIMEOUT=120 s,
#        NEWCOMER_CLIENT_PYTHON=<python with `openai`>, default this checkout's .venv from `make install-test`)
set -euo pipefail
set -m  # background jobs get their own process group, and SIGINT is not ignored in them (as in a terminal)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT=8080  # the README's base URL; deliberately not configurable: the point is the command exactly as written
START_TIMEOUT=${NEWCOMER_START_TIMEOUT:-1500}
STOP_TIMEOUT=${NEWCOMER_STOP_TIMEOUT:-120}
CLIENT_PY=${NEWCOMER_CLIENT_PYTHON:-$ROOT/.venv/bin/python}
T0=$SECONDS
WORK="" PGID="" CLONE=""

say() { printf '[newcomer %4ds] %s\n' $((SECONDS - T0)) "$*"; }
fail() {
  say "FAIL: $*"
  if [ -n "$WORK" ] && [ -f "$WORK/up.log" ]; then say "last lines of the command's output:"; tr '\r' '\n' <"$WORK/up.log" | tail -n 40; fi
  echo "newcomer check: FAIL after $((SECONDS - T0))s: $*"
  exit 1
}

port_busy() {  # something listens on 127.0.0.1:$1
  python3 - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    s.settimeout(1)
    sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
EOF
}

leftovers() {  # pids (other than ours) whose cwd or command line lies inside the clone
  local p cwd cmd
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = $$ ] || [ "$p" = "$BASHPID" ] && continue
    cwd=$(readlink "/proc/$p/cwd" 2>/dev/null) || continue
    cmd=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) || continue
    case "$cwd/ $cmd" in *"$CLONE"/*) echo "$p";; esac
  done
}

cleanup() {
  local rc=$? p
  trap - EXIT INT TERM
  cd /  # not inside the clone, which leftovers() scans and which is removed below
  if [ -n "$PGID" ] && kill -0 -- "-$PGID" 2>/dev/null; then
    kill -TERM -- "-$PGID" 2>/dev/null || true
    sleep 5
    kill -KILL -- "-$PGID" 2>/dev/null || true
  fi
  if [ -n "$CLONE" ]; then  # children of `make up` in their own sessions, only if something above went wrong
    for p in $(leftovers); do kill -KILL "$p" 2>/dev/null || true; done
  fi
  [ -n "$WORK" ] && rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'fail "interrupted"' INT TERM

[ -x "$CLIENT_PY" ] && "$CLIENT_PY" -c 'import openai' 2>/dev/null ||
  fail "no python with the openai client at $CLIENT_PY (run \`make install-test\` or set NEWCOMER_CLIENT_PYTHON)"
if port_busy "$PORT"; then fail "port $PORT is already in use; the README's command needs it free"; fi

HEAD=$(git -C "$ROOT" rev-parse HEAD)
[ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ] ||
  say "note: uncommitted changes in $ROOT are not part of this check (it clones commit ${HEAD:0:12})"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-newcomer.XXXXXX")
CLONE="$WORK/pdserve"
mkdir "$WORK/cache" "$WORK/hf"
git clone -q --no-hardlinks "$ROOT" "$CLONE"
git -C "$CLONE" checkout -q --detach "$HEAD"
say "cloned ${HEAD:0:12} into $CLONE"

# The first command of the Quickstart's code block, comment stripped: the check runs whatever the README says.
CMD=$(awk '/^## Quickstart/{q=1} q && /^```bash/{b=1; next} b{print; exit}' "$CLONE/README.md" | sed 's/[[:space:]]*#.*//')
[ -n "$CMD" ] || fail "could not find the first command of the README's Quickstart"
say "running the README's first command: $CMD"

# A fresh environment: nothing from an activated venv, the caller's PYTHONPATH or pdserve settings leaks in.
PATH_CLEAN=$PATH
[ -n "${VIRTUAL_ENV:-}" ] && PATH_CLEAN=$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$VIRTUAL_ENV/bin" | paste -sd: -)
UNSETS=(-u VIRTUAL_ENV -u PYTHONPATH -u PYTHONHOME -u MAKEFLAGS -u MAKELEVEL -u MFLAGS)
for v in $(compgen -e | grep '^PDSERVE_' || true); do UNSETS+=(-u "$v"); done
cd "$CLONE"
env "${UNSETS[@]}" PATH="$PATH_CLEAN" PDSERVE_CACHE_DIR="$WORK/cache" HF_HOME="$WORK/hf" PYTHONUNBUFFERED=1 \
  bash -c "$CMD" </dev/null >"$WORK/up.log" 2>&1 &
PGID=$!
set +m  # the job keeps its own process group; no job-status chatter from here on
cd "$WORK"

URL="http://127.0.0.1:$PORT/v1"
next_note=60
until grep -qF "OpenAI base URL: $URL" "$WORK/up.log"; do
  kill -0 "$PGID" 2>/dev/null || { wait "$PGID" && rc=0 || rc=$?; fail "'$CMD' exited with code $rc before printing $URL"; }
  [ $((SECONDS - T0)) -lt "$START_TIMEOUT" ] || fail "no base URL printed within ${START_TIMEOUT}s"
  if [ $((SECONDS - T0)) -ge "$next_note" ]; then
    say "waiting for $URL; last output: $(tail -c 2000 "$WORK/up.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -n 1 | cut -c1-120)"
    next_note=$((next_note + 60))
  fi
  sleep 3
done
say "up: $URL"

"$CLIENT_PY" - "$URL" <<'EOF' || fail "the chat completion failed"
import sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused", timeout=120, max_retries=0)
model = client.models.list().data[0].id
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello in one sentence."}],
                                   max_tokens=16, temperature=0)
text = r.choices[0].message.content
assert text and text.strip(), f"empty answer: {r}"
print(f"[newcomer] {model} answered: {text!r}")
EOF

# The pods' ports, from the command's own start-up lines, to check they are released too.
PORTS=$( (echo "$PORT"; grep -oE 'ready on port [0-9]+' "$WORK/up.log" | awk '{print $4}') | sort -un | paste -sd' ' -)
say "stopping with SIGINT to process group $PGID"
kill -INT -- "-$PGID"
deadline=$((SECONDS + STOP_TIMEOUT))
while kill -0 "$PGID" 2>/dev/null; do
  [ $SECONDS -lt $deadline ] || fail "'$CMD' still running ${STOP_TIMEOUT}s after SIGINT"
  sleep 1
done
wait "$PGID" || true  # make reports the interrupt as its own exit status; what matters is what is left running
PGID=""
grep -qx 'stopped.' "$WORK/up.log" || fail "pdserve up did not report a clean stop"
while :; do
  left=$(leftovers) busy=""
  for p in $PORTS; do if port_busy "$p"; then busy="$busy $p"; fi; done
  [ -z "$left$busy" ] && break
  if [ $SECONDS -ge $deadline ]; then
    for p in $left; do say "left running: $p $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)"; done
    fail "left behind after SIGINT: processes [${left//$'\n'/ }] ports [${busy# }]"
  fi
  sleep 1
done
say "stopped; no process or port ($PORTS) left"
echo "newcomer check: PASS in $((SECONDS - T0))s ('$CMD' on a clean clone of ${HEAD:0:12})"
