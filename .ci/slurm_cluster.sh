#!/usr/bin/env bash
# A real one-node Slurm cluster (munged, mariadbd + slurmdbd, slurmctld, slurmd; all as root)
# on this machine, for the grid runner's tests (CI) and for users who want to try submitit.
# Run `.ci/slurm_cluster.sh --help` for usage.
set -Eeuo pipefail

usage() {
  cat <<'EOF'
Usage: .ci/slurm_cluster.sh [options] start|stop|status|env

A one-node Slurm cluster on this machine (this host is the only node), run as root.
This script writes nothing to /etc (the Debian packages put their unused defaults there):
every file lives in the state directory, and the client commands (sbatch, srun, squeue, sacct,
scontrol, scancel, sinfo) find the cluster through SLURM_CONF.
By default it includes job accounting (slurmdbd + a private MariaDB server on 127.0.0.1), because
submitit reads job states with `sacct`: without it job.state is always UNKNOWN and job.result()
of a cancelled or failed-by-Slurm job waits forever.

Commands:
  start    install slurm-wlm + munge (+ slurmdbd + mariadb-server) with apt-get if binaries are
           missing, write munge.key, slurm.conf (+ slurmdbd.conf) into the state directory, start
           munged, (mariadbd, slurmdbd,) slurmctld and slurmd, wait until the node is idle, print
           the `export SLURM_CONF=...` line (the only output on stdout, so
           `out=$(cluster.sh start) && eval "$out"` works). Jobs left in the state directory
           by daemons that were killed without `stop` are cancelled. Does nothing (but print
           the line) when the cluster already runs.
  stop     cancel the cluster's jobs, stop the daemons started by `start` (pid files).
           Idempotent: exits 0 when nothing runs.
  status   sinfo / squeue summary (exits 1 when slurmctld does not answer).
  env      print the `export SLURM_CONF=...` line.

Options (each also settable through the environment variable in brackets):
  --state-dir DIR    state directory [TTA_SLURM_DIR, default /tmp/tta-slurm]
  --partition NAME   partition name [TTA_SLURM_PARTITION, default debug]
  --port N           slurmctld port; slurmd uses N+1, slurmdbd N+2, mariadbd N+3
                     [TTA_SLURM_PORT, default 6817]
  --no-accounting    no slurmdbd/MariaDB (sacct fails, submitit states stay UNKNOWN)
                     [TTA_SLURM_ACCOUNTING=0; default 1]
  --timeout S        seconds to wait for the node to become idle [TTA_SLURM_TIMEOUT, default 90]
  --mem-headroom MB  memory kept out of RealMemory [TTA_SLURM_MEM_HEADROOM_MB,
                     default max(1024, 10% of MemTotal)]
  --cred-expire S    Slurm's job credential lifetime, which is also how long a requeued job
                     waits before it can start again [TTA_SLURM_CRED_EXPIRE, default 10;
                     Slurm's default is 120]
  --no-install       fail instead of running apt-get when binaries are missing
  -h, --help         this help

Example:
  sudo .ci/slurm_cluster.sh start && export SLURM_CONF=/tmp/tta-slurm/etc/slurm.conf
  sbatch --wrap 'hostname' && squeue
  .ci/slurm_cluster.sh stop
EOF
}

STATE_DIR=${TTA_SLURM_DIR:-/tmp/tta-slurm}
PARTITION=${TTA_SLURM_PARTITION:-debug}
PORT=${TTA_SLURM_PORT:-6817}
TIMEOUT=${TTA_SLURM_TIMEOUT:-90}
HEADROOM_MB=${TTA_SLURM_MEM_HEADROOM_MB:-}
ACCOUNTING=${TTA_SLURM_ACCOUNTING:-1}
CRED_EXPIRE=${TTA_SLURM_CRED_EXPIRE:-10}
INSTALL=1
CMD=""

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --state-dir) STATE_DIR=$2; shift 2 ;;
    --state-dir=*) STATE_DIR=${1#*=}; shift ;;
    --partition) PARTITION=$2; shift 2 ;;
    --partition=*) PARTITION=${1#*=}; shift ;;
    --port) PORT=$2; shift 2 ;;
    --port=*) PORT=${1#*=}; shift ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --cred-expire) CRED_EXPIRE=$2; shift 2 ;;
    --cred-expire=*) CRED_EXPIRE=${1#*=}; shift ;;
    --timeout=*) TIMEOUT=${1#*=}; shift ;;
    --mem-headroom) HEADROOM_MB=$2; shift 2 ;;
    --mem-headroom=*) HEADROOM_MB=${1#*=}; shift ;;
    --no-install) INSTALL=0; shift ;;
    --accounting) ACCOUNTING=1; shift ;;
    --no-accounting) ACCOUNTING=0; shift ;;
    start|stop|status|env)
      [[ -z $CMD ]] || { echo "cluster.sh: only one command allowed" >&2; exit 2; }
      CMD=$1; shift ;;
    *) echo "cluster.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n $CMD ]] || { usage >&2; exit 2; }

STATE_DIR=$(realpath -m -- "$STATE_DIR")
CONF_DIR=$STATE_DIR/etc
CONF=$CONF_DIR/slurm.conf
RUN_DIR=$STATE_DIR/run
LOG_DIR=$STATE_DIR/log
MUNGE_DIR=$STATE_DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
DB_DIR=$STATE_DIR/mysql
DB_SOCKET=$DB_DIR/mysqld.sock
DBD_CONF=$CONF_DIR/slurmdbd.conf
export SLURM_CONF=$CONF
# Every client command below reads this cluster's config, never /etc/slurm/slurm.conf.
# The daemons live in /usr/sbin, which a non-login root shell may lack on PATH.
export PATH=$PATH:/usr/sbin:/sbin

msg() { printf 'cluster.sh: %s\n' "$*" >&2; }
die() { msg "ERROR: $*"; exit 1; }
trap 'msg "ERROR: \"$BASH_COMMAND\" failed (line $LINENO)"' ERR

proc_running() {  # proc_running PID -> 0 when PID exists and is not a zombie
  local stat
  kill -0 "$1" 2>/dev/null || return 1
  # A dead daemon stays a zombie until PID 1 reaps it (slowly in some containers).
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

pid_alive() {  # pid_alive DIR/NAME.pid -> 0 when the process in it runs and is NAME
  local pid exe name
  [[ -s $1 ]] || return 1
  pid=$(tr -dc '0-9' <"$1")
  [[ -n $pid ]] && proc_running "$pid" || return 1
  # A stale pid file whose pid now belongs to another program does not count.
  name=$(basename "$1" .pid)
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  exe=${exe##*/}
  [[ $exe == "$name"* ]]  # slurmctld runs as slurmctld-wlm (Debian alternatives)
}

daemon() {  # daemon NAME CMD...: run a self-daemonising CMD, its early output to a log file
  local name=$1
  shift
  "$@" </dev/null >>"$LOG_DIR/$name.stderr" 2>&1 || {
    log_tails
    die "$name did not start: $*"
  }
}

export_line() { echo "export SLURM_CONF=$CONF"; }

need_root() { [[ $(id -u) -eq 0 ]] || die "'$CMD' must run as root (the daemons run as root)"; }

install_packages() {
  local missing=0 b bins=(sbatch squeue sinfo scontrol slurmctld slurmd munged)
  local pkgs=(slurm-wlm munge)
  if [[ $ACCOUNTING == 1 ]]; then
    bins+=(slurmdbd sacctmgr mariadbd mariadb-install-db mariadb)
    pkgs+=(slurmdbd mariadb-server)
  fi
  for b in "${bins[@]}"; do
    command -v "$b" >/dev/null 2>&1 || missing=1
  done
  [[ $missing -eq 0 ]] && return 0
  [[ $INSTALL -eq 1 ]] || die "slurm/munge binaries missing and --no-install given"
  command -v apt-get >/dev/null || die "slurm/munge binaries missing and no apt-get"
  msg "installing ${pkgs[*]} with apt-get"
  # Keep the packages' maintainer scripts from starting system-wide daemons (there is no
  # system config for them; ours run from the state directory).
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; created_policy=1
  fi
  local rc=0
  {
    DEBIAN_FRONTEND=noninteractive apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${pkgs[@]}"
  } >&2 || rc=$?
  [[ $created_policy -eq 1 ]] && rm -f "$policy"
  [[ $rc -eq 0 ]] || die "apt-get failed (exit $rc)"
  for b in "${bins[@]}"; do
    command -v "$b" >/dev/null 2>&1 || die "'$b' still missing after apt-get install"
  done
}

write_config() {
  local node cpus mem_kb mem_mb headroom real_mem def_mem
  node=$(hostname -s)
  cpus=$(nproc)
  mem_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
  mem_mb=$((mem_kb / 1024))
  headroom=${HEADROOM_MB:-$((mem_mb / 10 > 1024 ? mem_mb / 10 : 1024))}
  real_mem=$((mem_mb - headroom))
  ((real_mem >= 256)) || real_mem=$((mem_mb / 2))
  # Jobs without --mem get DefMemPerCPU per CPU (not the whole node), so several run at once.
  def_mem=$((real_mem / cpus < 1024 ? real_mem / cpus : 1024))

  mkdir -p "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" "$MUNGE_DIR" "$STATE_DIR/ctld" \
    "$STATE_DIR/spool/slurmd-$node"
  # munged wants its socket directory searchable by all (clients of any user connect to it).
  chmod 755 "$STATE_DIR" "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" "$MUNGE_DIR" "$STATE_DIR/spool"
  chmod 700 "$STATE_DIR/ctld"
  if [[ ! -s $MUNGE_DIR/munge.key ]]; then
    (umask 077; head -c 1024 /dev/urandom >"$MUNGE_DIR/munge.key")
  fi
  chmod 400 "$MUNGE_DIR/munge.key"

  cat >"$CONF.tmp" <<EOF
# Written by .ci/slurm_cluster.sh: a one-node cluster on $node, everything as root.
ClusterName=tta
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=${CRED_EXPIRE}
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool/slurmd-%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: plain process tracking, no task containment.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
# Schedule every few seconds (defaults 60 s / 30 s): requeued jobs restart sooner.
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$def_mem
$(accounting_lines)
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Requeue (submitit's preemption/timeout path), short memory of finished jobs.
JobRequeue=1
MinJobAge=60
ReturnToService=2
KillWait=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
# The node: resources read from this machine (memory minus ${headroom} MB headroom).
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real_mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
  chmod 644 "$CONF"
  [[ $ACCOUNTING == 1 ]] || { rm -f "$DBD_CONF"; return 0; }

  mkdir -p "$DB_DIR"
  chmod 700 "$DB_DIR"
  if [[ ! -s $DB_DIR/storage.pass ]]; then
    (umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DB_DIR/storage.pass")
  fi
  (
    umask 077
    cat >"$DBD_CONF" <<EOF
# Written by .ci/slurm_cluster.sh: slurmdbd for the one-node cluster, MariaDB on 127.0.0.1.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=$node
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 3))
StorageUser=slurm
StoragePass=$(cat "$DB_DIR/storage.pass")
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$DBD_CONF"
}

accounting_lines() {
  if [[ $ACCOUNTING == 1 ]]; then
    cat <<EOF
# Accounting through slurmdbd (sacct is what submitit reads job states with).
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
# Munge socket for the connections to slurmdbd (AuthInfo is not used for those).
AccountingStoragePass=$MUNGE_SOCKET
EOF
  else
    cat <<EOF
# No accounting (sacct fails: submitit's job.state stays UNKNOWN).
AccountingStorageType=accounting_storage/none
EOF
  fi
}

mysql_root() { mariadb --no-defaults -S "$DB_SOCKET" -uroot "$@"; }

start_accounting() {
  local opts=(--no-defaults --user=root --datadir="$DB_DIR/data" --innodb-log-file-size=8M)
  if [[ ! -d $DB_DIR/data/mysql ]]; then
    msg "initialising the MariaDB data directory"
    rm -rf "$DB_DIR/data"
    mariadb-install-db "${opts[@]}" --auth-root-authentication-method=socket --skip-test-db \
      >"$LOG_DIR/mariadb-install-db.log" 2>&1 ||
      { tail -n 20 "$LOG_DIR/mariadb-install-db.log" >&2; die "mariadb-install-db failed"; }
  fi
  msg "starting mariadbd"
  rm -f "$DB_SOCKET"
  setsid mariadbd "${opts[@]}" --socket="$DB_SOCKET" --bind-address=127.0.0.1 \
    --port=$((PORT + 3)) --pid-file="$RUN_DIR/mariadbd.pid" --log-error="$LOG_DIR/mariadbd.log" \
    --innodb-buffer-pool-size=32M --skip-log-bin --skip-name-resolve \
    </dev/null >>"$LOG_DIR/mariadbd.stderr" 2>&1 &
  wait_for 60 "mariadbd" mysql_root -e 'SELECT 1'
  local pass
  pass=$(cat "$DB_DIR/storage.pass")
  mysql_root -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
    die "could not create the MariaDB user for slurmdbd"
  msg "starting slurmdbd"
  daemon slurmdbd slurmdbd
  wait_for 60 "slurmdbd to answer" sacctmgr -n list cluster
  if [[ -z $(sacctmgr -n -P list cluster format=cluster where cluster=tta 2>/dev/null) ]]; then
    sacctmgr -i add cluster tta >/dev/null || die "sacctmgr add cluster failed"
  fi
}

log_tails() {
  local f
  for f in "$LOG_DIR"/*.stderr "$LOG_DIR"/{munged,mariadbd,slurmdbd,slurmctld,slurmd}.log; do
    [[ -f $f ]] || continue
    echo "----- tail of $f" >&2
    tail -n 20 "$f" >&2 || true
  done
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND... (polls every 0.5 s)
  local secs=$1 what=$2 end
  shift 2
  end=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= end)); then
      msg "ERROR: timed out after ${secs}s waiting for $what"
      log_tails
      exit 1
    fi
    sleep 0.5
  done
}

node_idle() {
  local st
  st=$(sinfo -h -N -o '%T' 2>/dev/null) || return 1
  [[ $st == idle* || $st == mixed* || $st == allocated* ]]
}

cmd_start() {
  need_root
  local t0=$SECONDS
  if pid_alive "$RUN_DIR/slurmctld.pid" && pid_alive "$RUN_DIR/slurmd.pid" &&
    pid_alive "$RUN_DIR/munged.pid" &&
    { [[ $ACCOUNTING != 1 ]] || pid_alive "$RUN_DIR/slurmdbd.pid"; }; then
    msg "already running (state dir $STATE_DIR)"
    export_line
    return 0
  fi
  install_packages
  # A half-started cluster (one daemon died) is restarted from scratch.
  cmd_stop >/dev/null 2>&1 || true
  write_config

  msg "starting munged"
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  daemon munged munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$RUN_DIR/munged.pid" --log-file="$LOG_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" --force
  wait_for 20 "munged" munge -n -S "$MUNGE_SOCKET"
  [[ $ACCOUNTING != 1 ]] || start_accounting

  msg "starting slurmctld"
  daemon slurmctld slurmctld -f "$CONF"
  wait_for 30 "slurmctld to answer" scontrol ping
  # Jobs recovered from an earlier run's state (daemons killed without `stop`) would start
  # again: a fresh start has an empty queue. Job ids keep counting up.
  cancel_all_jobs "left over from an earlier run" || true

  msg "starting slurmd"
  daemon slurmd slurmd -f "$CONF" -N "$(hostname -s)"
  wait_for "$TIMEOUT" "node $(hostname -s) to be idle in sinfo" node_idle
  # A node left DOWN/DRAIN by an earlier session's state is resumed by ReturnToService=2.
  msg "cluster up in $((SECONDS - t0))s (state dir $STATE_DIR)"
  sinfo >&2 || true
  export_line
}

cancel_all_jobs() {  # cancel_all_jobs WHY -> 0 when there were jobs to cancel
  local ids
  mapfile -t ids < <(timeout 10 squeue -h -o %A 2>/dev/null | sort -u)
  ((${#ids[@]})) || return 1
  msg "cancelling jobs $1: ${ids[*]}"
  timeout 10 scancel "${ids[@]}" >/dev/null 2>&1 || true
}

stop_pidfile() {  # stop_pidfile NAME: SIGTERM, wait up to 15 s, then SIGKILL
  local name=$1 f=$RUN_DIR/$1.pid pid _
  if ! pid_alive "$f"; then rm -f "$f"; return 0; fi
  pid=$(tr -dc '0-9' <"$f")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do
    proc_running "$pid" || break
    sleep 0.5
  done
  if proc_running "$pid"; then
    msg "$name ($pid) ignored SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
  msg "stopped $name ($pid)"
}

stepd_pids() {  # slurmstepd processes started by this cluster's slurmd (env SLURM_CONF=$CONF)
  local p exe
  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    [[ ${exe##*/} == slurmstepd ]] || continue
    if tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF"; then
      echo "${p#/proc/}"
    fi
  done
}

cmd_stop() {
  [[ -d $RUN_DIR ]] || { msg "not running (no $RUN_DIR)"; return 0; }
  need_root
  local _ pids
  # Jobs first, so that slurmstepd kills their processes; then the daemons.
  if pid_alive "$RUN_DIR/slurmctld.pid" && timeout 10 scontrol ping >/dev/null 2>&1; then
    # submitit jobs ignore SIGTERM: they end after KillWait (10 s) with SIGKILL.
    if cancel_all_jobs "still in the queue"; then
      for _ in $(seq 1 40); do
        [[ -z $(timeout 10 squeue -h -t R,CG,S -o %i 2>/dev/null) ]] && break
        sleep 0.5
      done
    fi
  fi
  stop_pidfile slurmd
  stop_pidfile slurmctld
  stop_pidfile slurmdbd
  stop_pidfile mariadbd
  stop_pidfile munged
  mapfile -t pids < <(stepd_pids)
  if ((${#pids[@]})); then
    msg "killing leftover slurmstepd: ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  return 0
}

cmd_status() {
  if ! pid_alive "$RUN_DIR/slurmctld.pid"; then
    echo "slurmctld: not running (state dir $STATE_DIR)"
    return 1
  fi
  local d
  for d in munged mariadbd slurmdbd slurmctld slurmd; do
    if pid_alive "$RUN_DIR/$d.pid"; then
      echo "$d: running (pid $(tr -dc '0-9' <"$RUN_DIR/$d.pid"))"
    else
      echo "$d: not running"
    fi
  done
  export_line
  timeout 10 sinfo -N -l || return 1
  timeout 10 squeue -o '%.8i %.10P %.20j %.8T %.10M %.6D %R' || return 1
}

case $CMD in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status || exit 1 ;;  # (|| : no ERR-trap message for "not running")
  env) export_line ;;
esac
