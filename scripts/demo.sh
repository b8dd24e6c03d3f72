#!/usr/bin/env bash
# The main job on the embedded cluster: a real parallel C build (Lua 5.4, 33 files)
# through `starling exec`, timed against the same build done locally, outputs compared;
# then a remote fork: a running C program cloned onto every core of the cluster;
# then a terminal task that outlives its killed client and is re-attached (`starling attach`);
# then a live migration: a running program moved between three hosts, and a process tree; then Snowbird (a program started
# at home with `exec --roam`, moved to a host and back); then VMGL (an X11 window stays on your display while its
# program moves); then Linger-Longer (a guest
# under an active owner, an IE rerun); then a CA rotation under a running task; then a Slurm pilot job (`up --slurm`) on a local Slurm.
set -euo pipefail
cd "$(dirname "$0")/.."
S=$PWD/target/release/starling
[ "$(id -u)" = 0 ] || { echo "demo: the embedded cluster needs root (namespaces, mounts)"; exit 1; }
HOSTS=${HOSTS:-4}
JOBS=${JOBS:-8}

echo "== starting an embedded cluster of $HOSTS hosts"
$S down >/dev/null 2>&1 || true
$S up --hosts "$HOSTS"

SRC=$(tests/fixtures/fetch-lua.sh)
W=$(mktemp -d /var/tmp/starling-demo.XXXX)
trap 'rm -rf "$W"' EXIT
cp -r "$SRC" "$W/lua"
MK="make -s -f $PWD/tests/fixtures/lua/Makefile LUA_SRC=$W/lua"

echo
echo "== local build: make -j$JOBS (this machine has $(nproc) cores)"
mkdir "$W/local"
t0=$EPOCHREALTIME; (cd "$W/local" && $MK -j"$JOBS" CC=gcc); t1=$EPOCHREALTIME
awk -v a="$t0" -v b="$t1" 'BEGIN{printf "   %.1f s\n", b-a}'

echo "== cluster build #1: make -j$JOBS CC='starling exec gcc'  (host caches persist across runs; a fresh machine starts cold)"
mkdir "$W/cold"
t0=$EPOCHREALTIME; (cd "$W/cold" && $MK -j"$JOBS" CC="$S exec gcc"); t1=$EPOCHREALTIME
awk -v a="$t0" -v b="$t1" 'BEGIN{printf "   %.1f s\n", b-a}'

echo "== cluster build #2, warm: make -j$JOBS CC='starling exec --job demo gcc'"
mkdir "$W/warm"
t0=$EPOCHREALTIME; (cd "$W/warm" && $MK -j"$JOBS" CC="$S exec --job demo gcc"); t1=$EPOCHREALTIME
awk -v a="$t0" -v b="$t1" 'BEGIN{printf "   %.1f s\n", b-a}'

echo
echo "== comparing outputs"
(cd "$W/local" && find . -type f | sort | xargs sha256sum) > "$W/local.sums"
(cd "$W/warm" && find . -type f | sort | xargs sha256sum) > "$W/warm.sums"
(cd "$W/cold" && find . -type f | sort | xargs sha256sum) > "$W/cold.sums"
if cmp -s "$W/local.sums" "$W/warm.sums" && cmp -s "$W/local.sums" "$W/cold.sums"; then
    echo "   all $(wc -l < "$W/local.sums") output files are byte-identical to the local build"
else
    echo "   OUTPUTS DIFFER"; diff "$W/local.sums" "$W/warm.sums" || true; exit 1
fi
echo "== running the cluster-built interpreter on the cluster"
$S exec -- "$W/warm/luarun" -e 'print("hello from " .. io.popen("uname -n"):read("*l") .. ", 2^10 = " .. 2^10)'
echo
echo "== a terminal on the cluster (as ssh -t; automatic when stdin is your terminal): tty, stty size"
tty_out=$($S exec -t -- sh -c 'tty; stty size' < /dev/null | tr -d '\r')
echo "$tty_out" | sed 's/^/   /'
echo "$tty_out" | grep -q '^/dev/pts/[0-9]*$' || { echo "   NO TERMINAL"; exit 1; }
echo
echo "== a terminal task outlives its client: the client (in a pty, as \`script\` gives) is killed -9 after count 5;"
echo "   the task runs on, detached, and \`starling attach\` continues from the first byte that client had not written"
counter='i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo count $i; sleep 0.1; done; exit 3'
script -qfec "$S exec -t -- sh -c '$counter'" /dev/null > "$W/attach1.out" 2>&1 &
for _ in $(seq 1200); do grep -q 'count 5' "$W/attach1.out" && break; sleep 0.1; done
pkill -9 -f "^$S exec -t -- sh -c" || true
$S ps | awk 'NR == 1 || /detached/' | cut -c1-80 | sed 's/^/   /'
atask=$($S ps --json | python3 -c 'import json,sys; print(next(r["task"] for r in json.load(sys.stdin) if "count" in r["command"]))')
$S attach "$atask" < /dev/null > "$W/attach2.out" 2>&1 && rc=0 || rc=$?
counts() { grep -ao 'count [0-9]*' "$@"; }  # (the pty may echo a control character before the first)
seen=$(counts "$W/attach1.out" "$W/attach2.out" -h | wc -l)
distinct=$(counts "$W/attach1.out" "$W/attach2.out" -h | sort -u | wc -l)
echo "   first client printed up to $(counts "$W/attach1.out" | tail -1); attach printed $(counts "$W/attach2.out" | head -1) .. $(counts "$W/attach2.out" | tail -1), exit status $rc"
[ "$rc" = 3 ] && [ "$seen" = 40 ] && [ "$distinct" = 40 ] || { echo "   ATTACH LOST OR REPEATED OUTPUT ($seen lines, $distinct distinct, exit $rc)"; exit 1; }
echo
echo "== remote fork (C API): a ClustalW-style pairwise alignment; sf_clone puts $((HOSTS * 2)) clones of the"
echo "   running process on the hosts (hierarchical: one restore per host), they send scores back over TCP"
cc -O2 -Iinclude tests/fork/pairscores.c target/release/libstarling.a -lpthread -ldl -lm -o "$W/pairscores"
t0=$EPOCHREALTIME; out=$(cd "$W" && "$W/pairscores" $((HOSTS * 2)) 48 400 hier); t1=$EPOCHREALTIME
echo "$out" | grep -E "^clone [0-9]+ scored" | sort -V | head -3; echo "   ..."
echo "$out" | tail -1
awk -v a="$t0" -v b="$t1" 'BEGIN{printf "   %.1f s (matrix checked against a local computation)\n", b-a}'
echo "$out" | grep -q "wrong=0" || { echo "   PAIR SCORES WRONG"; exit 1; }
echo
if ${PYTHON:-python3} -c 'import starling, numpy' 2>/dev/null; then
    echo "== starling.Executor (Python): a 128 MiB array built before the pool, 16 calls each summing 1/64 of it on the cluster"
    ${PYTHON:-python3} - <<'PY'
import socket, numpy as np, starling
X = np.random.default_rng(0).random((1_000_000, 16))   # before the pool: the workers read it in place
with starling.Executor() as ex:
    sums = list(ex.map(lambda i: (X[i * 15_625:(i + 1) * 15_625].sum(), socket.gethostname()), range(16)))
    stats = ex.stats()
local = [X[i * 15_625:(i + 1) * 15_625].sum() for i in range(16)]
assert [s for s, _ in sums] == local, "remote sums differ from local ones"
print(f"   {ex.max_workers} workers on {', '.join(sorted({h for _, h in sums}))}; sums equal to local; "
      f"calls sent {stats['bytes_sent']} B of pickles, hosts fetched {stats['bytes_wire'] / 2**20:.1f} MiB of memory (the quarter of X read + interpreter pages)")
PY
else
    echo "== (skipping the Python Executor demo: make python installs the starling package)"
fi
echo
echo "== live migration: an unmodified program (64 MiB of its own data, printing its progress) started with"
echo "   \`starling exec\` on h1 is moved to h2, then h3, then back to h1 while it runs (\`starling migrate\`)"
cc -O1 tests/migrate/phases.c -o "$W/phases"
(cd "$W" && ./phases 4 4 "$W/local.bin" 64 < <(printf '\n\n\n') > "$W/phases.local") || [ $? = 7 ]
coproc MOVING { cd "$W" && exec "$S" exec --host h1 -- ./phases 4 4 "$W/moved.bin" 64 2>&1; }
exec {to_task}>&"${MOVING[1]}"
moved_out=()
read_until() { while IFS= read -r line <&"${MOVING[0]}"; do moved_out+=("$line"); [[ $line == "$1"* ]] && return 0; done; return 1; }
read_until "phase 0 done"
task=$($S ps --json | python3 -c 'import json,sys; print(next(r["task"] for r in json.load(sys.stdin) if "moved.bin" in r["command"]))')
$S ps
p=1
for to in h2 h3 h1; do
    echo "   starling migrate t$task --to $to"
    $S migrate "$task" --to "$to" | sed 's/^/   /'
    echo >&"$to_task"
    if [ $p -lt 3 ]; then read_until "phase $p done"; else read_until "done "; fi
    p=$((p + 1))
done
exec {to_task}>&-
wait "$MOVING_PID" && rc=0 || rc=$?
printf '%s\n' "${moved_out[@]}" > "$W/phases.moved"
if [ "$rc" = 7 ] && cmp -s "$W/phases.local" "$W/phases.moved" && cmp -s "$W/local.bin" "$W/moved.bin"; then
    echo "   its output ($(wc -l < "$W/phases.moved") lines), the file it wrote and its exit status are those of an undisturbed run"
else
    echo "   MOVED RUN DIFFERS (exit $rc)"; diff "$W/phases.local" "$W/phases.moved" || true; exit 1
fi
echo
echo "== live migration of POSIX timers: a program holding a 10 ms periodic timer and two one-shots (timer_create)"
echo "   moves from h1 to h2; the same timer ids come back, armed with the time they had left, and keep ticking"
cc -O1 tests/migrate/posix_timers.c -o "$W/posix_timers" -lrt
coproc TIMERS { cd "$W" && exec "$S" exec --host h1 -- ./posix_timers 2>&1; }
exec {to_timers}>&"${TIMERS[1]}"
timers_line() { local line; while IFS= read -r line <&"${TIMERS[0]}"; do [[ $line == "$1"* ]] && { echo "$line"; return 0; }; done; return 1; }
timers_line ready > /dev/null
echo >&"$to_timers"; before=$(timers_line report)
ttask=$($S ps --json | python3 -c 'import json,sys; print(next(r["task"] for r in json.load(sys.stdin) if "posix_timers" in r["command"]))')
$S migrate "$ttask" --to h2 | sed 's/^/   /'
echo >&"$to_timers"; after=$(timers_line report)
exec {to_timers}>&- {TIMERS[1]}>&-   # EOF: the program ends
wait "$TIMERS_PID" || true
echo "   before: ticks=$(cut -d' ' -f2 <<<"$before") ids=$(cut -d' ' -f3-6 <<<"$before") one-shot left $(( $(cut -d' ' -f7 <<<"$before") / 1000000 )) ms"
echo "   after:  ticks=$(cut -d' ' -f2 <<<"$after") ids=$(cut -d' ' -f3-6 <<<"$after") one-shot left $(( $(cut -d' ' -f7 <<<"$after") / 1000000 )) ms"
if [ "$(cut -d' ' -f3-6 <<<"$before")" != "$(cut -d' ' -f3-6 <<<"$after")" ] || [ "$(cut -d' ' -f2 <<<"$after")" -le "$(cut -d' ' -f2 <<<"$before")" ]; then
    echo "   TIMERS DID NOT MOVE"; exit 1
fi
echo
echo "== live migration of a process tree: a parent and its two children (each with its own heap; the parent"
echo "   will wait for them) move together from h1 to h2, then to h3; the parent still reaps their exit codes"
cc -O1 tests/migrate/tree.c -o "$W/tree"
{ (cd "$W" && ./tree 2 3 8 20 < <(printf '\n\n')) || [ $? = 7 ]; } | sort > "$W/tree.local"
coproc TREE { cd "$W" && exec "$S" exec --host h1 -- ./tree 2 3 8 20 2>&1; }
exec {to_tree}>&"${TREE[1]}"
tree_out=()
# Read until COUNT lines have matched the glob PATTERN (every process prints its own "pK phase N done").
tree_until() { local seen=0 line; while IFS= read -r line <&"${TREE[0]}"; do tree_out+=("$line"); [[ $line == $1 ]] && seen=$((seen + 1)); [ $seen -ge "$2" ] && return 0; done; return 1; }
tree_until "p? phase 0 done" 3
trtask=$($S ps --json | python3 -c 'import json,sys; print(next(r["task"] for r in json.load(sys.stdin) if "./tree 2 3" in r["command"]))')
p=1
for to in h2 h3; do
    $S migrate "$trtask" --to "$to" | sed 's/^/   /'
    echo >&"$to_tree"
    if [ $p -lt 2 ]; then tree_until "p? phase $p done" 3; else tree_until "done" 1; fi
    p=$((p + 1))
done
exec {to_tree}>&-
wait "$TREE_PID" && rc=0 || rc=$?
printf '%s\n' "${tree_out[@]}" | sort > "$W/tree.moved"
printf '%s\n' "${tree_out[@]}" | grep -E "^reaped|^done" | sed 's/^/   /'
if [ "$rc" = 7 ] && cmp -s "$W/tree.local" "$W/tree.moved"; then
    echo "   every process's lines ($(wc -l < "$W/tree.moved")), the reaped exit codes and the exit status (7) are those of an undisturbed run"
else
    echo "   MOVED TREE DIFFERS (exit $rc)"; diff "$W/tree.local" "$W/tree.moved" || true; exit 1
fi
echo
echo "== Snowbird: a program started at home with \`starling exec --roam\` (this machine, same view of your files)"
echo "   moves to h2 for a phase and comes back home (\`starling migrate TASK --to h2|home\`); \`ps\` says where and why;"
echo "   at home its terminal talks to this client directly (\`home (direct)\`), away through the head"
(cd "$W" && ./phases 4 3 "$W/home.bin" 16 < <(printf '\n\n') > /dev/null) || [ $? = 7 ]
coproc ROAMING { cd "$W" && exec "$S" exec --roam -T -- ./phases 4 3 "$W/roamed.bin" 16 2>&1; }
exec {to_roaming}>&"${ROAMING[1]}"
roam_until() { local line; while IFS= read -r line <&"${ROAMING[0]}"; do [[ $line == "$1"* ]] && return 0; done; return 1; }
roam_until "phase 0 done"
rtask=$($S ps --json | python3 -c 'import json,sys; print(next(r["task"] for r in json.load(sys.stdin) if "roamed.bin" in r["command"]))')
$S ps | awk -v t="t$rtask" 'NR == 1 || $1 == t' | sed 's/^/   /'
p=1
for to in h2 home; do
    $S migrate "$rtask" --to "$to" | sed 's/^/   /'
    $S ps | awk -v t="t$rtask" 'NR == 1 || $1 == t' | sed 's/^/   /'
    echo >&"$to_roaming"
    if [ $p -lt 2 ]; then roam_until "phase $p done"; else roam_until "done "; fi
    p=$((p + 1))
done
exec {to_roaming}>&-
wait "$ROAMING_PID" && rc=0 || rc=$?
if [ "$rc" = 7 ] && cmp -s "$W/home.bin" "$W/roamed.bin"; then
    echo "   the file it wrote at home, on h2 and at home again, and its exit status, are those of an undisturbed run"
else
    echo "   ROAMED RUN DIFFERS (exit $rc)"; exit 1
fi
echo
if command -v Xvfb >/dev/null && command -v xauth >/dev/null && command -v xdpyinfo >/dev/null \
   && command -v xwininfo >/dev/null && command -v xprop >/dev/null && [ -f /usr/include/X11/Xlib.h ]; then
    echo "== VMGL: the display stays with you. Your X server (an Xvfb here, 1234x567, admitting only its cookie)"
    echo "   is used by programs on the hosts through \`exec -X\` (as ssh -X: the real cookie never leaves);"
    echo "   an Xlib program's window stays up while the program moves h1 -> h2 -> h3"
    xauthf="$W/Xauthority"; : > "$xauthf"
    exec {xfd}> >(cat > "$W/xvfb.display")
    Xvfb -displayfd "$xfd" -screen 0 1234x567x24 -auth "$xauthf" -nolisten tcp 2> "$W/xvfb.log" &
    XVFB_PID=$!
    exec {xfd}>&-
    for _ in $(seq 100); do [ -s "$W/xvfb.display" ] && break; sleep 0.1; done
    xdisplay=":$(head -1 "$W/xvfb.display")"
    xauth -f "$xauthf" add "$xdisplay" MIT-MAGIC-COOKIE-1 "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
    export DISPLAY="$xdisplay" XAUTHORITY="$xauthf"
    $S exec -X -T --host h2 -- xdpyinfo | grep dimensions | sed 's/^ */   on h2, xdpyinfo: /'
    gcc -O1 -o "$W/ticker" tests/x11/ticker.c -lX11
    coproc TICKER { cd "$W" && exec "$S" exec -X -T --host h1 -- ./ticker starling-demo-window 2>&1; }
    read -r _ wid <&"${TICKER[0]}"
    xtask=$($S ps --json | python3 -c 'import json,sys; print(next(r["task"] for r in json.load(sys.stdin) if "./ticker" in r["command"]))')
    ticks() { xprop -id "$wid" STARLING_TICKS | sed 's/.*= //'; }
    echo "   window $wid made on h1; its program has bumped a property $(ticks) times"
    for to in h2 h3; do
        $S migrate "$xtask" --to "$to" | sed 's/^/   /'
        before=$(ticks); sleep 1
        if xwininfo -root -tree | grep -q "$wid \"starling-demo-window\"" && [ "$(ticks)" -gt "$before" ]; then
            echo "   on $to: the same window $wid, and its program's requests still reach the server ($(ticks) bumps)"
        else
            echo "   THE WINDOW DID NOT SURVIVE THE MOVE TO $to"; exit 1
        fi
    done
    kill -INT "$TICKER_PID" 2>/dev/null || true
    wait "$TICKER_PID" 2>/dev/null || true
    kill "$XVFB_PID"; wait "$XVFB_PID" 2>/dev/null || true
    unset DISPLAY XAUTHORITY
else
    echo "== (skipping the VMGL display step: it needs Debian's xvfb, xauth, x11-utils and libx11-dev, as .ci/run installs)"
fi
echo
echo "== Linger-Longer: a guest on h1 while h1's owner burns every core (guest at cpu.idle)"
G=$($S status --json | python3 -c 'import json,sys; print([h for h in json.load(sys.stdin)["hosts"] if h["name"]=="h1"][0]["owner"]["guest_cgroup"])')
$S exec --host h1 -- sh -c 'while :; do :; done' & GP=$!
$S owner h1 -- sh -c '(while :; do :; done) & a=$!; (while :; do :; done) & b=$!; sleep 5; kill $a $b' & OP=$!
sleep 1; g0=$(cat /sys/fs/cgroup/cpuacct/$G/cpuacct.usage); sleep 3; g1=$(cat /sys/fs/cgroup/cpuacct/$G/cpuacct.usage)
$S status | grep -A1 OWNER | tail -1
awk -v a="$g0" -v b="$g1" 'BEGIN{printf "   guest CPU while the owner ran: %.3f s in 3 s\n", (b-a)/1e9}'
wait $OP 2>/dev/null || true; kill $GP 2>/dev/null || true; wait $GP 2>/dev/null || true  # the guest ends by SIGTERM (143)
echo "== Linger-Longer IE: a guest started on h1 with --policy IE; h1's owner comes back (keyboard), the guest"
echo "   is killed there and rerun from the start on an idle host; its output is shown once, its files are the rerun's"
(cd "$W" && rm -f where.txt && exec "$S" exec --host h1 --policy IE -- sh -c 'uname -n > where.txt; i=0; while [ $i -lt 12 ]; do i=$((i+1)); echo "   line $i"; sleep 0.25; done; exit 3') > "$W/ie.out" &
IEP=$!
# Wait (at most 5 minutes) for a condition.
within_5min() { for _ in $(seq 1500); do "$@" && return 0; sleep 0.2; done; echo "   timed out waiting for: $*"; exit 1; }
within_5min grep -q "line 3" "$W/ie.out"
$S owner h1 --active
rerun_seen() { $S ps --json | python3 -c 'import json,sys; sys.exit(0 if any("rerun" in r["state"] and "where.txt" in r["command"] for r in json.load(sys.stdin)) else 1)'; }
within_5min rerun_seen
$S ps | grep -E "TASK|where.txt" | cut -c1-110 | sed 's/^/   /'
$S owner h1 --idle
wait $IEP && rc=0 || rc=$?
if [ "$rc" = 3 ] && [ "$(cat "$W/ie.out")" = "$(for i in $(seq 1 12); do echo "   line $i"; done)" ] && [ "$(cat "$W/where.txt")" != h1 ]; then
    echo "   12 lines, each once; exit status 3; where.txt says $(cat "$W/where.txt") (the killed run's file on h1 was discarded)"
else
    echo "   IE RERUN DIFFERS (exit $rc)"; cat "$W/ie.out"; exit 1
fi
echo
echo "== Security: the cluster's CA is replaced while a task runs (\`starling ca rotate\`, then \`--finish\`): the"
echo "   task and the agents' connections carry on, and the agents get certificates of the new CA over them"
mkfifo "$W/rot.in"
(cd "$W" && exec "$S" exec --host h2 -- sh -c 'echo "   a task on $(uname -n) started before the rotation"; read x; echo "   ... and ended after it: $x"') < "$W/rot.in" > "$W/rot.out" &
RP=$!
exec 7>"$W/rot.in"
within_5min grep -q "started before" "$W/rot.out"
echo "   new CA: $($S ca rotate 2>/dev/null | cut -c1-16)..."
echo "   during the window, a new task runs on $($S exec -- uname -n)"
$S ca rotate --finish 2>&1 | sed 's/^starling: /   /'
echo "   after --finish, a new task runs on $($S exec -- uname -n); hosts connected: $($S status --json | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["hosts"]))')"
echo "its input" >&7; exec 7>&-
wait $RP || { echo "   THE TASK STARTED BEFORE THE ROTATION FAILED"; cat "$W/rot.out"; exit 1; }
cat "$W/rot.out"
echo
# A pilot job on a real Slurm (scripts/slurm-local.sh: slurmctld + 2 slurmd in network namespaces on this
# machine), as on a cluster where Slurm owns the nodes: `up --slurm` asks Slurm for them, the agents run as
# a job step, and `down` cancels the job. Its own instance, so the embedded cluster above stays up.
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    echo "== Slurm pilot: starling up --slurm -N 2 on a local Slurm of 2 nodes; run -n 4 lands on Slurm's nodes"
    SLURM_INST=${DEMO_SLURM_INSTANCE:-5}
    scripts/slurm-local.sh up 2 | sed 's/^/   /'
    export SLURM_CONF=/run/starling-slurm/slurm.conf
    STARLING_INSTANCE=$SLURM_INST $S down >/dev/null 2>&1 || true
    STARLING_INSTANCE=$SLURM_INST $S up --slurm -N 2 | sed 's/^/   /'
    (cd "$W" && STARLING_INSTANCE=$SLURM_INST "$S" run -n 4 --quiet -- sh -c 'echo "   task $STARLING_TASK ran on $(uname -n)"') | sort
    STARLING_INSTANCE=$SLURM_INST $S down -v | sed 's/^/   /'
    scripts/slurm-local.sh down | sed 's/^/   /'
    unset SLURM_CONF
else
    echo "== (skipping the Slurm pilot: it needs Debian's slurmctld, slurmd, slurm-client and munge, as .ci/run installs)"
fi
echo
$S status
echo
echo "The cluster is still up: try \`starling exec -- uname -n\`; \`starling down\` removes it."
