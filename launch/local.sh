#!/usr/bin/env bash
# Run N copies of `python -m lm_jax.main ARGS...` on this machine as N "hosts" of one JAX job, to
# exercise multi-host code paths (process-local data, cross-process collectives, orbax) on a CPU.
#
#   launch/local.sh 2 --config=configs/gpt1.py:tiny --workdir=/tmp/gpt1_2proc
#
# Each process sees LM_JAX_DEVICES_PER_PROCESS simulated CPU devices (default 4) and joins the
# coordinator through lm_jax.distributed (LM_JAX_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID);
# cross-process collectives use gloo, JAX's CPU default. Logs: $LM_JAX_LOG_DIR/process_<i>.log
# (default: a fresh /tmp directory); process 0's log is also streamed here. Exits with the first
# nonzero exit status and then stops the other processes (they would otherwise wait for the dead
# one until JAX's heartbeat timeout). SIGINT/SIGTERM are forwarded, so trainers checkpoint.
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch/local.sh NUM_PROCESSES [lm_jax.main args ...]" >&2
  exit 2
fi
num=$1; shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
devices=${LM_JAX_DEVICES_PER_PROCESS:-4}
logdir=${LM_JAX_LOG_DIR:-$(mktemp -d /tmp/lm_jax_local.XXXXXX)}
mkdir -p "$logdir"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

for ((i = 0; i < num; i++)); do : >"$logdir/process_$i.log"; done   # exist before tail opens process 0's
declare -A index  # pid -> process index, for the processes still running
for ((i = 0; i < num; i++)); do
  LM_JAX_COORDINATOR=127.0.0.1:$port LM_JAX_NUM_PROCESSES=$num LM_JAX_PROCESS_ID=$i \
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$devices${XLA_FLAGS:+ $XLA_FLAGS}" \
  PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" -m lm_jax.main "$@" >"$logdir/process_$i.log" 2>&1 &
  index[$!]=$i
done
echo "launch/local.sh: $num processes x $devices CPU devices, coordinator 127.0.0.1:$port, logs in $logdir" >&2
tail -n +1 -f "$logdir/process_0.log" --pid=$$ &
tailer=$!

stop_all() { for p in "${!index[@]}"; do kill -"$1" "$p" 2>/dev/null || true; done; }
trap 'stop_all TERM' TERM
trap 'stop_all INT' INT

status=0
while ((${#index[@]})); do
  rc=0 done_pid=""
  wait -n -p done_pid "${!index[@]}" || rc=$?
  [[ -z $done_pid ]] && continue  # a trapped signal interrupted wait
  i=${index[$done_pid]}
  unset "index[$done_pid]"
  if ((rc != 0 && status == 0)); then
    echo "launch/local.sh: process $i exited with status $rc; see $logdir/process_$i.log" >&2
    status=$rc
    stop_all TERM
  fi
done
sleep 0.2  # let tail print process 0's last lines
kill "$tailer" 2>/dev/null || true
exit "$status"
