#!/usr/bin/env bash
# Make (up) or remove (down) a few fake "servers" on this one machine, to try gradbed's
# Mininet Cluster Edition runs without a cluster (docs/cluster.md). Each server is:
#
#   - a network namespace gbfc-sN, its interface ctl0 (10.99.0.N/24) on the root bridge
#     gbfc0 (10.99.0.254/24): the servers' underlay and control network;
#   - a mount namespace with its own /run (a bind mount of STATE/sN/run): every server
#     keeps its own network lock (/run/gradbed) and sshd state, as separate machines do;
#   - a time namespace whose CLOCK_MONOTONIC is offset by N * 1000 s: the servers' clocks
#     really differ, as on separate machines;
#   - a pid namespace with its own /proc, sshd its first process: a server sees (and its
#     cleanup kills) only its own processes, and killing its sshd ends all of them;
#   - its own sshd (Debian's openssh-server, never the system service), root login by a
#     key made here for this cluster only, no password.
#
# Every address is one of these namespaces' (10.99.0.0/24, on gbfc0); nothing leaves the
# machine. Needs root, iproute2, util-linux's unshare and openssh-server
# (GRADBED_WITH_SSHD=1 scripts/setup.sh installs it without enabling its service).
#
#   scripts/fake_cluster.sh up STATE_DIR [N]   # N servers (default 2), 10.99.0.1 .. 10.99.0.N
#   scripts/fake_cluster.sh down STATE_DIR     # kill the sshds, remove namespaces, bridge, keys
#
# "up" writes STATE/ssh_config (user, key, known hosts for every server), so
#   ssh -F STATE/ssh_config 10.99.0.2 hostname
# runs on server 2. "down" removes exactly what "up" made, and is safe to repeat.
set -euo pipefail

BRIDGE=gbfc0
NS_PREFIX=gbfc-s
SUBNET=10.99.0
MONO_STEP_S=1000

usage() { echo "usage: $0 up STATE_DIR [N] | down STATE_DIR" >&2; exit 2; }

server_up() {  # $1 = N, $2 = STATE
    local n=$1 state=$2 ns="${NS_PREFIX}$1" dir="$2/s$1"
    mkdir -p "$dir/run"
    ip netns add "$ns"
    ip link add "${NS_PREFIX}$n" type veth peer name ctl0 netns "$ns"
    ip link set "${NS_PREFIX}$n" master "$BRIDGE" up
    ip -n "$ns" addr add "$SUBNET.$n/24" dev ctl0
    ip -n "$ns" link set ctl0 up
    ip -n "$ns" link set lo up
    ssh-keygen -q -t ed25519 -N '' -C "fake-server-$n" -f "$dir/host_key"
    cat > "$dir/sshd_config" <<EOF
ListenAddress $SUBNET.$n
HostKey $dir/host_key
PidFile /run/sshd.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile $state/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
StrictModes no
PermitTunnel yes
MaxSessions 100
MaxStartups 100:30:200
Subsystem sftp internal-sftp
EOF
    # sshd -D stays in the foreground as the namespaces' first process; setsid detaches it
    # from this script. The inner shell binds the private /run first.
    setsid ip netns exec "$ns" \
        unshare --mount --propagation private --time --pid --fork --mount-proc \
        --monotonic "$((n * MONO_STEP_S))" -- \
        sh -c "mount --bind '$dir/run' /run && mkdir -p /run/sshd && chmod 0755 /run/sshd \
               && exec /usr/sbin/sshd -D -e -f '$dir/sshd_config'" \
        </dev/null >"$dir/sshd.log" 2>&1 &
    echo $! > "$dir/launcher.pid"
    echo "$SUBNET.$n $(cut -d' ' -f1,2 "$dir/host_key.pub")" >> "$state/known_hosts"
}

sshd_pid() {  # $1 = the server's state dir: its sshd's pid on this machine (the child of
    # the launcher, unshare, which waits for it), or nothing
    pgrep -P "$(cat "$1/launcher.pid" 2>/dev/null || echo 0)" 2>/dev/null | head -1 || true
}

wait_ssh() {  # $1 = N, $2 = STATE
    local i
    for i in $(seq 1 100); do
        if ssh -F "$2/ssh_config" "$SUBNET.$1" true 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    echo "fake server $1: sshd did not answer; its log:" >&2
    cat "$2/s$1/sshd.log" >&2
    return 1
}

up() {  # $1 = STATE, $2 = N
    local state=$1 n=${2:-2} i
    [[ $n =~ ^[1-9]$ ]] || { echo "N=$n: allowed 1..9 servers" >&2; exit 2; }
    [ -x /usr/sbin/sshd ] || { echo "no /usr/sbin/sshd: GRADBED_WITH_SSHD=1 scripts/setup.sh" >&2; exit 2; }
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        echo "$BRIDGE exists: a fake cluster is up already ($0 down STATE_DIR first)" >&2
        exit 1
    fi
    mkdir -p "$state"
    state=$(cd "$state" && pwd)
    echo "$n" > "$state/servers"
    ssh-keygen -q -t ed25519 -N '' -C gradbed-fake-cluster -f "$state/id_ed25519"
    cp "$state/id_ed25519.pub" "$state/authorized_keys"
    : > "$state/known_hosts"
    # curve25519 alone, not OpenSSH's default sntrup761 hybrid: the servers are this
    # machine's namespaces, a run opens tens of ssh connections, and the post-quantum
    # key exchange's CPU (a third of a connection's time here) is taken from the run.
    cat > "$state/ssh_config" <<EOF
Host $SUBNET.*
    User root
    IdentityFile $state/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $state/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 5
    ServerAliveInterval 2
    ServerAliveCountMax 3
    KexAlgorithms curve25519-sha256
EOF
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.254/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in $(seq 1 "$n"); do server_up "$i" "$state"; done
    for i in $(seq 1 "$n"); do wait_ssh "$i" "$state"; done
    echo "fake cluster up: $n servers $SUBNET.1 .. $SUBNET.$n (ssh -F $state/ssh_config)"
}

time_ns_pids() {  # every process in the time namespace of pid $1 (a server's descendants)
    local want
    want=$(readlink "/proc/$1/ns/time" 2>/dev/null) || return 0
    # One find reads every process's link (a readlink per process forks hundreds of times).
    find /proc/[0-9]*/ns/time -maxdepth 0 -printf '%p %l\n' 2>/dev/null \
        | awk -v want="$want" '$2 == want { split($1, f, "/"); print f[3] }'
    return 0
}

down() {  # $1 = STATE
    local state=$1 n i pid ns
    n=$(cat "$state/servers" 2>/dev/null || echo 9)
    for i in $(seq 1 "$n"); do
        ns="${NS_PREFIX}$i"
        # Everything the server runs shares its time namespace: its sshd, the sessions and
        # what they started, in its network namespace or in the hosts' below it. A run
        # removes its own; what a killed run left goes with its server here.
        pid=$(sshd_pid "$state/s$i")
        if [ -n "$pid" ]; then
            for p in $(time_ns_pids "$pid"); do kill -9 "$p" 2>/dev/null || true; done
        fi
        if ip netns pids "$ns" >/dev/null 2>&1; then
            for p in $(ip netns pids "$ns"); do kill -9 "$p" 2>/dev/null || true; done
        fi
        ip netns del "$ns" 2>/dev/null || true
        ip link del "${NS_PREFIX}$i" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf "$state"
}

[ $# -ge 2 ] || usage
case "$1" in
    up) up "$2" "${3:-2}" ;;
    down) down "$2" ;;
    *) usage ;;
esac
