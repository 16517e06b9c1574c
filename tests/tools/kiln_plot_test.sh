#!/usr/bin/env bash
# kiln_plot reads two runs' metrics.jsonl and writes a PNG of one metric over step and over time; a metric no
# run holds, a bad option and a missing run are errors (exit 1) that say so. Usage: kiln_plot_test.sh KILN_PLOT
set -uo pipefail
plot=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
mkdir -p "$dir/a" "$dir/b"
for i in 1 2 3 4; do
  echo "{\"step\":$((i * 100)),\"time\":$i.5,\"val_loss\":$(awk "BEGIN{print 3 - $i * 0.4}"),\"lr\":0.001}" >> "$dir/a/metrics.jsonl"
  echo "{\"step\":$((i * 100)),\"time\":$((i * 2)).0,\"val_loss\":$(awk "BEGIN{print 3 - $i * 0.3}"),\"lr\":null}" >> "$dir/b/metrics.jsonl"
done
"$plot" "$dir/steps.png" --metric val_loss --hline 1.5 "$dir/a=fast" "$dir/b/metrics.jsonl=slow" || fail "plot over steps"
"$plot" "$dir/time.png" --metric val_loss --x time --log-y --title t "$dir/a" "$dir/b" || fail "plot over time"
for f in steps time; do
  [ "$(head -c 8 "$dir/$f.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "$f.png is not a PNG"
done
msg=$("$plot" "$dir/x.png" --metric nope "$dir/a" 2>&1) && fail "a missing metric was accepted"
echo "$msg" | grep -q "has no 'nope' values" || fail "unclear message: $msg"
msg=$("$plot" "$dir/x.png" --metric val_loss "$dir/missing" 2>&1) && fail "a missing run was accepted"
echo "$msg" | grep -q "cannot open" || fail "unclear message: $msg"
msg=$("$plot" "$dir/x.png" --metric val_loss --x epochs "$dir/a" 2>&1) && fail "a bad --x was accepted"
echo "$msg" | grep -q "step or time" || fail "unclear message: $msg"
echo PASS
