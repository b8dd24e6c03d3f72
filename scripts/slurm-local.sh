#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for trying and testing `starling up --slurm`.
#
#   scripts/slurm-local.sh up [NODES]   # munge + slurmctld + NODES slurmd (default 4), wait until idle
#   scripts/slurm-local.sh down         # stop all of it and remove everything it made
#   scripts/slurm-local.sh status       # sinfo of the local cluster
#
# Each node snI is a network namespace (stslurm-snI, address 10.214.0.(10+I) on the bridge stslurm,
# 10.214.0.1/24) with its own hostname (UTS namespace) running `slurmd -N snI`; slurmctld runs in
# this machine's namespace on the bridge address and munged as user munge. Needs root and Debian's
# slurmctld, slurmd, slurm-client and munge packages. The Slurm commands find the cluster through
# SLURM_CONF: after `up`, run `export SLURM_CONF=/run/starling-slurm/slurm.conf` (the script prints it).
#
# `up` is idempotent (a running cluster of the same size is left as it is; another size is replaced);
# `down` leaves no process, namespace, link or directory behind (munged only if `up` started it).
# Settings (environment): SLURM_LOCAL_DIR (default /run/starling-slurm), SLURM_LOCAL_BRIDGE
# (stslurm), SLURM_LOCAL_NET (10.214.0: the first three octets of the /24).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/run/starling-slurm}
BRIDGE=${SLURM_LOCAL_BRIDGE:-stslurm}
NET=${SLURM_LOCAL_NET:-10.214.0}
NS_PREFIX="$BRIDGE-"
VETH_PREFIX="stsl-"
CONF="$DIR/slurm.conf"
HOST=$(hostname -s)
export SLURM_CONF="$CONF"

die() { echo "slurm-local: $*" >&2; exit 1; }
say() { echo "slurm-local: $*"; }

need_tools() {
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces, slurmd)"
    local missing=()
    for t in slurmctld:slurmctld slurmd:slurmd sinfo:slurm-client munged:munge mungekey:munge ip:iproute2 unshare:util-linux; do
        command -v "${t%%:*}" >/dev/null || missing+=("${t#*:}")
    done
    [ ${#missing[@]} -eq 0 ] || die "missing tools: apt-get install -y $(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')"
}

node_count() { [ -f "$DIR/nodes" ] && cat "$DIR/nodes" || echo 0; }

# Is a cluster of N nodes up and answering, every node idle or busy (not down)?
healthy() {
    local n=$1 states
    [ "$(node_count)" = "$n" ] || return 1
    states=$(timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    [ "$(echo "$states" | grep -cE ' (idle|mixed|allocated|completing)')" = "$n" ]
}

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

kill_pidfile() {
    local f=$1 pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f" 2>/dev/null || true)
    if pid_alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

down() {
    [ "$(id -u)" = 0 ] || die "needs root"
    local removed=0
    # Everything inside the nodes' namespaces: slurmd, slurmstepd, job steps (starling agents...).
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$NS_PREFIX" || true); do
        for _ in 1 2 3; do
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [ -z "$pids" ] && break
            kill -KILL $pids 2>/dev/null || true
            sleep 0.2
        done
        ip netns del "$ns" && removed=$((removed + 1))
    done
    kill_pidfile "$DIR/slurmctld.pid"
    # A slurmctld or slurmd of ours whose pid file is gone: found by its config path.
    for p in $(pgrep -f "slurm(ctld|d) .*-f $CONF" || true); do kill -KILL "$p" 2>/dev/null || true; done
    if [ -f "$DIR/munged.ours" ]; then
        kill_pidfile "$DIR/munged.pid"
        rm -f "$DIR/munged.ours"
        if [ -f "$DIR/munge-rundir.ours" ]; then rm -rf /run/munge; fi
    fi
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$VETH_PREFIX" || true); do
        ip link del "$l" 2>/dev/null || true
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
    rm -rf "$DIR"
    say "down (removed $removed node namespaces, bridge $BRIDGE, $DIR)"
}

start_munge() {
    [ -f /etc/munge/munge.key ] || mungekey -c
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return  # a munged is already running (the system's or ours): use it
    fi
    [ -d /run/munge ] || touch "$DIR/munge-rundir.ours"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    touch "$DIR/munged.ours"
    # munged writes its own pid file; started as user munge as the package's service does.
    runuser -u munge -- munged
    for _ in $(seq 100); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n </dev/null | unmunge >/dev/null || die "munged did not start"
    cp /run/munge/munged.pid "$DIR/munged.pid"
}

write_conf() {
    local n=$1 cpus
    cpus=$(nproc)
    mkdir -p "$DIR/ctld" "$DIR/spool" "$DIR/log"
    {
        echo "# written by scripts/slurm-local.sh: a $n-node Slurm cluster on $HOST"
        echo "ClusterName=starling"
        echo "SlurmctldHost=$HOST($NET.1)"
        echo "SlurmUser=root"
        echo "AuthType=auth/munge"
        echo "StateSaveLocation=$DIR/ctld"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$DIR/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "MailProg=/bin/true"
        echo "ReturnToService=2"
        echo "KillWait=5"
        echo "MinJobAge=10"
        echo "SlurmdTimeout=30"
        echo "InactiveLimit=0"
        for i in $(seq "$n"); do
            echo "NodeName=sn$i NodeHostname=sn$i NodeAddr=$NET.$((10 + i)) CPUs=$cpus State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } > "$CONF"
    printf 'CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n' > "$DIR/cgroup.conf"
    echo "$n" > "$DIR/nodes"
}

up() {
    local n=${1:-4}
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 32 ] || die "NODES must be 1..32, not $n"
    need_tools
    if healthy "$n"; then
        say "already up: $n nodes"
        echo "export SLURM_CONF=$CONF"
        return
    fi
    down >/dev/null
    mkdir -p "$DIR"
    start_munge
    write_conf "$n"

    ip link add "$BRIDGE" type bridge
    ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in $(seq "$n"); do
        local ns="${NS_PREFIX}sn$i" veth="${VETH_PREFIX}sn$i"
        ip netns add "$ns"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" addr add "$NET.$((10 + i))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" route add default via "$NET.1"
    done

    slurmctld -f "$CONF" || die "slurmctld did not start: $(tail -5 "$DIR/log/slurmctld.log" 2>/dev/null)"
    for i in $(seq "$n"); do
        # Its own hostname too (a UTS namespace), so jobs on it see the node's name.
        ip netns exec "${NS_PREFIX}sn$i" unshare --uts sh -c "hostname sn$i && exec slurmd -f '$CONF' -N sn$i" \
            || die "slurmd sn$i did not start: $(tail -5 "$DIR/log/slurmd-sn$i.log" 2>/dev/null)"
    done
    for _ in $(seq 600); do
        healthy "$n" && break
        sleep 0.1
    done
    healthy "$n" || die "nodes not idle after 60 s: $(sinfo -h -N -o '%N %T %E' 2>&1 | tr '\n' ';') (logs in $DIR/log)"
    say "up: $n nodes ($(sinfo -h -o '%N' | tr '\n' ' ')), controller $HOST($NET.1)"
    echo "export SLURM_CONF=$CONF"
}

case "${1:-}" in
    up) up "${2:-4}" ;;
    down) down ;;
    status) sinfo ;;
    *) echo "usage: $0 up [NODES] | down | status" >&2; exit 2 ;;
esac
