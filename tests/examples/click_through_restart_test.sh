#!/usr/bin/env bash
# examples/click_through --elastic under distrun --restart-policy rank, small (two parameter
# servers and two trainers, 50 steps of 512 samples each, a 16k x 8 table): trainer KILLED (0 or
# 1) SIGKILLs itself in step 30 (--kill-trainer-at, --kill-trainer), after its backward pass, and
# distrun starts it again alone. restart_checks.sh checks the exit status, distrun's summary, the
# first server's log and that the replacement's losses lie below the fresh model's; here, also
# that the replacement's first steps lie closer to where the model stood at the kill than to where
# it started (a replacement on a fresh model would start there). Trainer 0 reports (held-out
# evaluations, click_through.csv): when it is the one killed, its replacement goes on with the
# same CSV (one header, evaluation steps rising from 0 to the last) and its closing line compares
# with the held-out loss from before training, the CSV's first.
# Usage: click_through_restart_test.sh DISTRUN EXAMPLE WORKDIR KILLED
set -euo pipefail
distrun="$1" example="$2" work="$3" killed_trainer="$4"
rm -rf "$work" && mkdir -p "$work"
steps=50 kill_at=30
other_trainer=$((1 - killed_trainer))

source "$(dirname "$0")/restart_checks.sh"

run_killing 4 --kill-trainer "$killed_trainer" --steps $steps --batch 512 --rows 16384 --dim 8 \
  --held-out 2000 --eval-every 10 --seed 3 --out "$work/out"
check_restart ps0 $((2 + killed_trainer)) "trainer$killed_trainer" "trainer$other_trainer" \
  $kill_at $steps 8 "$work/out/loss.csv"

# The reporter's CSV: one header, evaluations from step 0 to the last in rising order on one
# clock (the seconds never go back), and the closing line's loss before training is the CSV's
# first.
report="$work/out/click_through.csv"
[[ $(grep -c '^step,' "$report") -eq 1 ]] || fail "click_through.csv has not exactly one header"
awk -F, -v last=$steps 'NR == 2 && $1 != 0 { exit 1 } NR > 2 && ($1 <= step || $3 < seconds) { exit 1 }
  NR > 1 { step = $1; seconds = $3 } END { exit step != last }' "$report" ||
  fail "click_through.csv's evaluations do not rise from step 0 to $steps on one clock:" \
       "$(cut -d, -f1,3 "$report" | tr '\n' ' ')"
before=$(awk -F, 'NR == 2 { printf "%.4f", $6 }' "$report")
grep -q "after $steps steps per trainer, $before\( (AUC [0-9.]*)\)\? before training" "$work/run.log" ||
  fail "the closing line does not compare with the loss before training, $before"
# The replacement starts closer to where the model stood at the kill than to where it started
# (a replacement on a fresh model would start there): the mean loss of its first 8 steps lies
# below the midpoint of the log's first 4 steps (any worker's: the fresh model) and of the 8
# steps before the kill.
read -r fresh at_kill < <(awk -F, '$2 == "kill" { k = c } $2 == "step" { l[++c] = $7 }
  END { for (i = 1; i <= 4; ++i) f += l[i]; for (i = k - 7; i <= k; ++i) b += l[i]
        print f / 4, b / 8 }' \
  "$work/out/loss.csv")
awk -v f="$fresh" -v b="$at_kill" -v r="$back_first" 'BEGIN { exit !(r < (f + b) / 2) }' ||
  fail "the replacement's first steps (mean loss $back_first) are closer to the fresh model's" \
       "($fresh) than to the model's at the kill ($at_kill)"
echo "PASSED: the replacement's first steps (mean loss $back_first) below the midpoint of the" \
     "fresh model's ($fresh) and the model's at the kill ($at_kill)"
