#!/usr/bin/env bash
# An optimizer's flags given without that optimizer are an error naming the flag, before any data is read
# (they used to be ignored silently); so is a CUDA graph asked for where the optimizer cannot follow it. Usage: example_flags_test.sh FASHION_MNIST CHAR_GPT
set -u
fashion=$1 char=$2
fail=0
expect_error() {  # expect_error PATTERN COMMAND...
  local pattern=$1; shift
  local out
  if out=$("$@" 2>&1); then echo "FAIL: '$*' succeeded"; fail=1; return; fi
  if ! grep -q -- "$pattern" <<<"$out"; then echo "FAIL: '$*' did not say '$pattern':"; echo "$out" | tail -3; fail=1; fi
}
expect_error "--kfac-damping sets K-FAC, which runs only with --optimizer kfac (this run's optimizer: adamw)" \
  "$fashion" --kfac-damping 0.1
expect_error "--kfac-kl-clip sets K-FAC, which runs only with --optimizer kfac (this run's optimizer: sgd)" \
  "$fashion" --optimizer sgd --kfac-kl-clip 0.01
expect_error "--shampoo-warm sets Shampoo, which runs only with --optimizer shampoo (this run's optimizer: adamw)" \
  "$char" --shampoo-warm
expect_error "--shampoo-root-tf32 sets Shampoo, which runs only with --optimizer shampoo" "$char" --shampoo-warm --shampoo-root-tf32
expect_error "--shampoo-root-tf32 puts the warm roots' products on TF32 and needs --shampoo-warm" "$char" --optimizer shampoo --shampoo-root-tf32
expect_error "--shampoo-tf32 and --shampoo-bf16 choose two precisions" "$char" --optimizer shampoo --shampoo-tf32 --shampoo-bf16
expect_error "choose two root methods" "$char" --optimizer shampoo --shampoo-warm --shampoo-newton-tf32
expect_error "runs only with --shampoo-newton-tf32" "$char" --optimizer shampoo --shampoo-newton-iterations 30
expect_error "--cuda-graph with --optimizer shampoo needs --amp bf16 or none" \
  "$char" --optimizer shampoo --amp f16 --cuda-graph
[ $fail = 0 ] && echo PASS
exit $fail
