#!/usr/bin/env bash
# Diagnosis for a rank that the NCCL kill test saw hang: runs the nccl-kill job's two ranks by hand with
# KILN_WATCHDOG_DEBUG=1 and, if rank 0 is still alive after WAIT seconds, prints where each of its threads
# sleeps (/proc: name, wchan, syscall; a gdb backtrace of every thread where gdb exists), then ends it.
# Usage: nccl_hang_probe.sh PROGRAM [WAIT=20]
set -uo pipefail
program=$1
wait_s=${2:-20}
export NCCL_NVLS_ENABLE=0 KILN_WATCHDOG_DEBUG=1
port=$(( 29500 + RANDOM % 200 ))
RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$program" nccl-kill > /tmp/probe_rank1.log 2>&1 &
r1=$!
RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$program" nccl-kill > /tmp/probe_rank0.log 2>&1 &
r0=$!
for _ in $(seq "$wait_s"); do kill -0 $r0 2>/dev/null || break; sleep 1; done
dump=""
if kill -0 $r0 2>/dev/null; then
  dump="rank 0 (pid $r0) alive after $wait_s s; its threads:"$'\n'
  for t in /proc/$r0/task/*; do
    dump+="  $(basename "$t") $(cat "$t/comm") wchan=$(cat "$t/wchan" 2>/dev/null) syscall=$(cut -d' ' -f1 "$t/syscall" 2>/dev/null)"$'\n'
  done
  command -v gdb > /dev/null && dump+=$(timeout 60 gdb -p $r0 -batch -ex "thread apply all bt 12" 2>/dev/null | grep -E "^Thread|^#" | head -150)
  kill -9 $r0
fi
wait $r0; echo "rank 0 exit status $?"
wait $r1; echo "rank 1 exit status $?"
echo "---- rank 1 output"; tail -5 /tmp/probe_rank1.log
echo "---- rank 0 output (without the begin/launched lines)"; grep -v "\] \(begin\|launched\) #" /tmp/probe_rank0.log
echo "---- where rank 0's threads were"; echo "$dump"
