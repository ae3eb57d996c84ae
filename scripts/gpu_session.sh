#!/usr/bin/env bash
# What fits one command on a GPU lent for minutes (the device tool: 15 minutes a session, 10 a
# command; scripts/gpu_suite.sh runs everything and takes longer): the extension from .device/,
# the kernel harness's checks, every CUDA test under the default choice and with each tensor-core
# family forced, and the benchmark against SDPA, each step bounded by what is left of DEADLINE.
#
#   bash scripts/device_bundle.sh make                # here, before the lease: .device/
#   DEADLINE=420 bash scripts/gpu_session.sh          # there (carry .device); OUT: where results go,
#                                                     # COMMIT: the commit to record (default git's)
#
# Steps:
#   1. the library and the kernel harness of .device/ (scripts/device_bundle.sh install);
#   2. in the background, the harness's checks of every family (build/kernel_harness
#      --checks-only), again with the shared memory per block capped at 99 KB (the sm80
#      backward's compact tiles) and with the Hopper backward's dq by atomics;
#   3. `pytest tests -k "cuda or CUDA"` in nproc/2 processes side by side (ENTROPY_ATTN_TEST_SHARD,
#      JUnit records), under "auto", then the deterministic Hopper backward's tests and the Hopper
#      kernels' at head dim 256 (marked hopper_turns, hopper_256) in a pass of their own (a hang
#      costs its bound alone);
#   4. the harness's timings of the sm90 family, then the same timings of the baseline harness of
#      .device/ (the kernels last timed on a GPU: scripts/device_bundle.sh, BASELINE) and their
#      comparison (scripts/harness_ab.py: what the kernels changed since did, in this lease), the
#      Hopper forward on a block per tile against a persistent grid (--persistent off on:
#      family.h, kHopperPersistentByDefault), benchmarks/gpu_vs_sdpa.py (bf16, D 64 and 128, L 1024
#      to 16384, the README's grid), the CUDA tests again with ENTROPY_ATTN_CUDA_FAMILY=sm90 (and the
#      Hopper forward's persistent grid on) and =sm80, and compute-sanitizer's racecheck of the
#      persistent grid (what decides what to keep first, then the record against SDPA);
#   5. as time allows, the harnesses of the commits between the baseline and these kernels
#      (device_bundle.sh: STEPS), whose comparison then says what each step did; the forward with
#      and without statistics under Nsight Compute (gpu_profile.py --calls fwd fwd_stats: the SM
#      clock and pipes of each); racecheck over
#      the Hopper family's forward and backward (cuda_sanitizer_grid.py --passes sm90), and of its
#      backward under deterministic algorithms (--passes sm90-deterministic); a second run of
#      the current and baseline harnesses, whose comparison then takes each point's least time
#      over the two runs of each; one decoding step (benchmarks/gpu_decode.py, split-KV
#      settings; head dim 96, padded, against the fallback) and the causal calls under both launch
#      orders (gpu_vs_sdpa.py --launch-order auto heads); the masked calls (--mask none bool
#      additive, into the logs); the Hopper kernels at head dim 256 against the sm80 ones that
#      "auto" runs (gpu_vs_sdpa.py --head-dim 256 --family auto sm90, into the logs); memcheck
#      over masks that end within a word of their storage's end (cuda_sanitizer_grid.py
#      --variants bool_mask_tight additive_mask_tight); a learned bias's forward and backward
#      (benchmarks/learned_bias.py, by default and with the Hopper family forced, into the logs); the
#      backward under deterministic algorithms in sm80 and sm90, and in the fallback at float32
#      (benchmarks/deterministic_backward.py, into the logs); the fixed cost
#      of a call (benchmarks/call_overhead.py --quick, into the logs); the Nsight Compute profile
#      of the default path (benchmarks/gpu_profile.py, into the logs).
# A crash ends only its own process's share of the tests (its log ends in the fault's traceback).
# The exit code is 1 when a step failed, or when a step of 1-4 ran out of time; a step of 5 that the
# deadline cut short or left out is listed at the end ("cut by the deadline"), not failed (one that
# ran past its own bound before the deadline, a hang, fails). 2 when the run could not start (no
# GPU, or a .device/ made from other sources: it would be built there, at the lease's expense).
# OUT (default build/gpu_session) receives benchmark.md and .json, harness.md, harness_ab.md,
# persistent.md, decode.md, launch_order.md and logs.tar.xz (every log, and the JSON of the
# harnesses, the persistent grid, decoding and the launch orders; packed after each step, so that a
# run cut short still returns what it did): 8 files, as many as the device tool brings back
# (tests/test_gpu_session_script.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$(date +%s)
DEADLINE=${DEADLINE:-420}
OUT=${OUT:-build/gpu_session}
LOGS=$(mktemp -d)/logs
mkdir -p "$OUT" "$LOGS"
PYTHON=${PYTHON:-python3}
SHARDS=${SHARDS:-$(($(nproc) / 2 > 1 ? $(nproc) / 2 : 1))}

note() { echo "::: $* [$(($(date +%s) - T0))s]"; }
pack() { tar -C "$(dirname "$LOGS")" -cJf "$OUT/logs.tar.xz" logs 2>/dev/null || true; }
# bounded SECONDS CMD...: CMD for at most SECONDS, or what is left before DEADLINE if less (then
# capped=1, for record).
capped=0
bounded() {
  local s=$1 left
  shift
  capped=0
  left=$((DEADLINE - ($(date +%s) - T0)))
  if ((left < s)); then
    s=$left
    capped=1
  fi
  if ((s < 5)); then
    echo "skipped (deadline): $*"
    return 124
  fi
  timeout -k 5 "$s" "$@"
}

if ! nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv >"$LOGS/smi.txt" 2>&1; then
  echo "gpu_session: no GPU here (nvidia-smi: $(head -1 "$LOGS/smi.txt"))" >&2
  exit 2
fi
cat "$LOGS/smi.txt"
if [[ ! -d .device ]]; then
  echo "gpu_session: no .device/ (make it with scripts/device_bundle.sh make and carry it)" >&2
  exit 2
fi
if [[ $(cat .device/sources.sha256 2>/dev/null) != "$(bash scripts/sources_hash.sh)" ]]; then
  echo "gpu_session: .device/ was made from other sources than these (scripts/sources_hash.sh):" \
    "make it again with scripts/device_bundle.sh make" >&2
  exit 2
fi
if [[ $(cat .device/harness.sha256 2>/dev/null) != "$(bash scripts/sources_hash.sh --harness)" ]]; then
  echo "gpu_session: the kernel harness of .device/ was built from another harness source" \
    "(scripts/sources_hash.sh --harness): make it again with scripts/device_bundle.sh make" >&2
  exit 2
fi
status=0
# optional: 1 from the steps "as time allows" on (5 above); cut: those of them the deadline ended.
optional=0
cut=()
# record WHAT RC: prints the step's exit code; a failed step fails the run, except a step as time
# allows that timed out (124, or 137 when it had to be killed) because the deadline capped it.
record() {
  local was_capped=$capped
  capped=0
  if ((optional && was_capped)) && (($2 == 124 || $2 == 137)); then
    echo "  $1: cut by the deadline"
    cut+=("$1")
    return
  fi
  echo "  $1: exit $2"
  (($2 == 0)) || status=1
}
note "install (scripts/device_bundle.sh install)"
if ! bash scripts/device_bundle.sh install >"$LOGS/install.log" 2>&1; then
  tail -20 "$LOGS/install.log"
  pack
  exit 1
fi
tail -1 "$LOGS/install.log"

note "harness checks (in the background)"
(
  bounded 200 build/kernel_harness --checks-only --families fallback,sm80,sm90 >"$LOGS/harness_checks.md" 2>&1
  echo "exit $?" >>"$LOGS/harness_checks.md"
  ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK=101376 bounded 120 build/kernel_harness --checks-only --families sm80 \
    >"$LOGS/harness_checks_99KB.md" 2>&1
  echo "exit $?" >>"$LOGS/harness_checks_99KB.md"
  bounded 120 build/kernel_harness --checks-only --families sm90 --sm90-atomic-dq \
    >"$LOGS/harness_checks_atomic_dq.md" 2>&1
  echo "exit $?" >>"$LOGS/harness_checks_atomic_dq.md"
) &
harness_pid=$!

# tests NAME SECONDS: every CUDA test in $SHARDS processes, their last lines and failures printed.
tests() {
  local name=$1 seconds=$2 k pids=()
  note "pytest ${name} (${SHARDS} processes)"
  for ((k = 0; k < SHARDS; k++)); do
    ENTROPY_ATTN_TEST_SHARD=$k/$SHARDS OMP_NUM_THREADS=2 ENTROPY_ATTN_REQUIRE_CUDA=1 \
      bounded "$seconds" "$PYTHON" -m pytest tests -q -rfEs -p no:cacheprovider --maxfail=12 \
      -k "cuda or CUDA" -m "not hopper_turns and not hopper_256" --junitxml="$LOGS/$name.$k.xml" \
      >"$LOGS/$name.$k.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for ((k = 0; k < SHARDS; k++)); do
    wait "${pids[$k]}" || rc=1
    echo "  [$k] $(tail -1 "$LOGS/$name.$k.log")"
  done
  grep -h "^FAILED\|^ERROR" "$LOGS/$name".*.log | head -20
  record "pytest ${name}" "$rc"
  pack
}
tests auto 150
# The tests of the deterministic Hopper backward (dq in turns, sm90/bwd_kernel.cuh: write_dq; added
# 2026-12-07, not yet run on a GPU; with a learned mask's gradient too; marked hopper_turns) and of
# the Hopper kernels at head dim 256 (written 2026-12-07 without a GPU; marked hopper_256), left out
# of the passes above and below, in a pass of their own: a turn its blocks never reach, or a
# transaction count a TMA never completes, would spin until the bound, which then costs these
# seconds alone, not a shard of the other passes (79 tests since the Hopper backward at 256 joined
# them: a bound of 130 s). (The forced sm90 pass below still runs head dim 256 in the tests that
# take the family from the environment.)
note "pytest hopper deterministic"
ENTROPY_ATTN_REQUIRE_CUDA=1 bounded 130 "$PYTHON" -m pytest tests -q -rfEs -p no:cacheprovider \
  -m "hopper_turns or hopper_256" >"$LOGS/pytest_deterministic.log" 2>&1
record "pytest hopper deterministic" $?
echo "  $(tail -1 "$LOGS/pytest_deterministic.log")"
pack
# (The harness's checks share the GPU with the tests, not with the timings below.)
wait "$harness_pid"
for f in "$LOGS"/harness_checks*.md; do
  echo "  $(basename "$f"): $(grep -h "checks, " "$f" | tail -1)"
  grep -q "^exit 0$" "$f" || status=1
done

# harness_timings EXECUTABLE COMMIT NAME: the harness's sm90 timings into $LOGS/NAME.{json,md,log}.
harness_timings() {
  bounded 60 "$1" --quick --families sm90 --commit "$2" --json "$LOGS/$3.json" >"$LOGS/$3.md" 2>"$LOGS/$3.log"
  record "harness timings (${3})" $?
}
note "harness timings (sm90)"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
harness_timings build/kernel_harness "$commit" harness
cp "$LOGS/harness.md" "$OUT/harness.md"
if [[ -x build/kernel_harness_baseline ]]; then
  baseline=$(cat .device/baseline 2>/dev/null || echo baseline)
  note "baseline harness timings (sm90, the kernels of ${baseline})"
  harness_timings build/kernel_harness_baseline "$baseline" harness_baseline
  "$PYTHON" scripts/harness_ab.py --baseline "$LOGS/harness_baseline.json" \
    --current "$LOGS/harness.json" --out-md "$OUT/harness_ab.md"
  record "harness comparison" $?
fi
pack
# (At L = 16384 a tile walks 128 key blocks: what the persistent grid saves per tile is a few
# percent at L = 1024 and less at 4096, and nothing to see there.)
note "persistent grid (sm90 forward)"
bounded 60 "$PYTHON" benchmarks/gpu_vs_sdpa.py --dtype bf16 --heads-kv 16:16 32:8 --head-dim 64 128 \
  --seq 1024 4096 --family auto --persistent off on --no-backward --min-run-time 0.2 \
  --out-md "$OUT/persistent.md" --out-json "$LOGS/persistent.json" >"$LOGS/persistent.log" 2>&1
record "persistent grid" $?
pack
note "benchmark against SDPA"
bounded 130 "$PYTHON" benchmarks/gpu_vs_sdpa.py --dtype bf16 --heads-kv 16:16 32:8 --head-dim 64 128 \
  --seq 1024 4096 16384 --family auto --min-run-time 0.2 --out-md "$OUT/benchmark.md" \
  --out-json "$OUT/benchmark.json" >"$LOGS/benchmark.log" 2>&1
record benchmark $?
# The tests with each tensor-core family forced, after what decides which kernels to keep: on an
# H100 or H200 "auto" above ran the Hopper family, but its forward on a block per tile. (The forced
# sm90 pass runs it on its persistent grid: both pass before kHopperPersistentByDefault changes.)
ENTROPY_ATTN_CUDA_FAMILY=sm90 ENTROPY_ATTN_CUDA_PERSISTENT=on tests sm90 100
ENTROPY_ATTN_CUDA_FAMILY=sm80 tests sm80 100
# racecheck SECONDS WORD: compute-sanitizer's racecheck over the passes of
# scripts/cuda_sanitizer_grid.py that WORD names, into $LOGS/racecheck_WORD.log. SANITIZER: the
# tool (default: the machine's; none: nothing runs).
sanitizer=${SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)}
racecheck() {
  [[ -n $sanitizer ]] || return 0
  note "racecheck of the grid's passes named ${2}"
  bounded "$1" "$sanitizer" --tool racecheck --error-exitcode 9 "$PYTHON" scripts/cuda_sanitizer_grid.py \
    --passes "$2" >"$LOGS/racecheck_$2.log" 2>&1
  record "racecheck (${2})" $?
  tail -3 "$LOGS/racecheck_$2.log"
  pack
}
# The persistent grid's pass (one block walking every tile: the next tile's slots and the
# hand-offs between tiles), before kHopperPersistentByDefault may change.
racecheck 90 sm90-persistent
optional=1
# As time allows, the harnesses of the commits between the baseline and these kernels
# (device_bundle.sh: STEPS), once each, and the comparison again with what each step bought
# (harness_ab.md): after the record against SDPA, which their runs (each with its checks) would
# otherwise push past the deadline.
steps=()
if [[ -s $LOGS/harness.json && -s $LOGS/harness_baseline.json ]]; then
  for step in $(cat .device/steps 2>/dev/null); do
    [[ -x build/kernel_harness_$step ]] || continue
    note "harness timings of step ${step}"
    harness_timings "build/kernel_harness_$step" "$step" "harness_$step"
    [[ -s $LOGS/harness_$step.json ]] && steps+=("$LOGS/harness_$step.json")
  done
  if ((${#steps[@]} > 0)); then
    "$PYTHON" scripts/harness_ab.py --baseline "$LOGS/harness_baseline.json" \
      --current "$LOGS/harness.json" --steps "${steps[@]}" --out-md "$LOGS/harness_ab_steps.md"
    record "harness comparison with the steps" $?
    cp "$LOGS/harness_ab_steps.md" "$OUT/harness_ab.md"
  fi
  pack
fi
# As time allows, the forward with and without statistics under Nsight Compute (D = 128, full
# attention, L = 4096): the SM clock and the pipes of each say whether the statistics' cost at
# D = 128, which no static replay of the loop shows (results/sass/pingpong_model.md), is the
# clock under the power cap. (The whole profile comes last.)
ncu=${NCU:-$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)}
if [[ -n $ncu ]]; then
  note "profile of the statistics (Nsight Compute)"
  bounded 60 "$PYTHON" benchmarks/gpu_profile.py --ncu "$ncu" --causal no --calls fwd fwd_stats \
    --out "$LOGS/profile_stats.md" >"$LOGS/profile_stats.log" 2>&1
  record "profile of the statistics" $?
  pack
fi
# As time allows, the Hopper family's passes (forward and backward of every variant: the
# backward's schedule changed since the last GPU run, dV issued before the dS step, dK in flight
# into the next block, one dS tile, checked so far in the CPU emulation only).
racecheck 150 sm90
# And the Hopper backward under deterministic algorithms (its turns: the dq writer's bulk
# reductions, the masked kernels' turn keeper and its named barriers; a learned bias's gradient at
# the full shape), not yet run on a GPU: a turn never reached would spin until the bound.
racecheck 60 sm90-deterministic
# As time allows, a second run of each harness, in the other order (a drift of the clocks over the
# lease then favours neither), and their comparison again over both runs of each (harness_ab.py:
# each point's least time).
if [[ -x build/kernel_harness_baseline && -s $LOGS/harness.json && -s $LOGS/harness_baseline.json ]]; then
  note "second harness timings (current, then baseline)"
  harness_timings build/kernel_harness "$commit" harness_2
  harness_timings build/kernel_harness_baseline "$baseline" harness_baseline_2
  if [[ -s $LOGS/harness_2.json && -s $LOGS/harness_baseline_2.json ]]; then
    "$PYTHON" scripts/harness_ab.py --baseline "$LOGS/harness_baseline.json" "$LOGS/harness_baseline_2.json" \
      --current "$LOGS/harness.json" "$LOGS/harness_2.json" --steps "${steps[@]}" \
      --out-md "$OUT/harness_ab.md"
    record "harness comparison over both runs" $?
  fi
  pack
fi
note "decoding"
bounded 60 "$PYTHON" benchmarks/gpu_decode.py --split off auto 8 16 --out-md "$OUT/decode.md" \
  --out-json "$LOGS/decode.json" >"$LOGS/decode.log" 2>&1
record decode $?
# (Head dim 96 decodes on inputs padded to 128, copying the cache at each step: against the
# fallback, which reads it as it is. Not measured yet.)
for family in auto fallback; do
  bounded 40 "$PYTHON" benchmarks/gpu_decode.py --head-dim 96 --split auto \
    --family "$family" --out-md "$LOGS/decode_d96_$family.md" --out-json "$LOGS/decode_d96_$family.json" \
    >"$LOGS/decode_d96_$family.log" 2>&1
  record "decode at head dim 96, ${family}" $?
done
note "launch orders"
bounded 90 "$PYTHON" benchmarks/gpu_vs_sdpa.py --dtype bf16 --head-dim 64 128 --seq 1024 4096 --causal yes \
  --launch-order auto heads --min-run-time 0.2 --out-md "$OUT/launch_order.md" \
  --out-json "$LOGS/launch_order.json" >"$LOGS/launch_order.log" 2>&1
record "launch orders" $?
pack
# The masked kernels, which no other step times: a padded batch's (B, 1, L, L) mask as a Hugging
# Face model passes it, bool and additive, against SDPA with the same mask (their backward's mask
# lines prefetched into L1 since 2026-12-06, not yet timed).
note "masks"
bounded 60 "$PYTHON" benchmarks/gpu_vs_sdpa.py --dtype bf16 --heads-kv 16:16 --head-dim 64 128 --seq 4096 \
  --causal yes --mask none bool additive --min-run-time 0.2 --out-md "$LOGS/masks.md" \
  --out-json "$LOGS/masks.json" >"$LOGS/masks.log" 2>&1
record masks $?
pack
# The Hopper forward and backward at head dim 256 (Gemma's; 64-key blocks, written 2026-12-07
# without a GPU, off by default until their tests pass: family.h, kHopperHeadDim256ByDefault and
# kHopperBackwardHeadDim256ByDefault; their kernels are in the bundle's build, compiled on request)
# against the sm80 kernels that "auto" runs there, and SDPA.
note "head dim 256 (sm90)"
bounded 90 "$PYTHON" benchmarks/gpu_vs_sdpa.py --dtype bf16 --heads-kv 16:16 --head-dim 256 --seq 4096 16384 \
  --family auto sm90 --check --min-run-time 0.2 --out-md "$LOGS/head_dim_256.md" \
  --out-json "$LOGS/head_dim_256.json" >"$LOGS/head_dim_256.log" 2>&1
record "head dim 256" $?
pack
# As time allows, memcheck over the masks whose entries end within a word of their storage's end
# (cuda_sanitizer_grid.py: *_tight), each tensor its own exact cudaMalloc
# (PYTORCH_NO_CUDA_MEMORY_CACHING=1): the tensor-core forwards' word copies of a bool or 16-bit
# mask stay within its storage (attention_inputs.h: word_readable, added 2026-12-06).
if [[ -n $sanitizer ]]; then
  note "memcheck of the tight masks"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 bounded 90 "$sanitizer" --tool memcheck --error-exitcode 9 \
    "$PYTHON" scripts/cuda_sanitizer_grid.py --passes sm80 sm90 --head-dims 64 128 \
    --variants bool_mask_tight additive_mask_tight >"$LOGS/memcheck_masks.log" 2>&1
  record "memcheck (tight masks)" $?
  tail -3 "$LOGS/memcheck_masks.log"
  pack
fi
# A learned (1, H, L, L) bias that requires grad (T5's relative positions, at T5's head dim 64 and
# 12 heads): forward and backward against SDPA with the same bias, both checked first. Its backward
# ran on the fallback kernels until 2026-12-06, now in the sm80 family by default (its mask's
# gradient by atomics), and in the Hopper family when forced (a loss of the output alone:
# family.h, kHopperMaskGradByDefault, off until it has passed the CUDA tests on a GPU), neither
# timed yet: both, into the logs
# (learned_bias/cuda.md and .json; learned_bias_sm90/). Both also with a learned bias per key,
# (B, 1, 1, L), whose gradient a warp sums over its rows of each key before one atomic per key
# (csrc/cuda/logit_grads.cuh). The first also under deterministic algorithms (--deterministic: the
# gradient written at the call's full shape and summed in a fixed order, attention_cuda.cpp, since
# 2026-12-07; two runs' bits compared first).
note "learned bias"
bounded 90 "$PYTHON" benchmarks/learned_bias.py --device cuda --dtype bfloat16 --head-dim 64 \
  --heads 12 --batch 4 --lengths 1024 4096 --bias head key --deterministic --min-run-time 0.2 \
  --out "$LOGS/learned_bias" >"$LOGS/learned_bias.log" 2>&1
record "learned bias" $?
ENTROPY_ATTN_CUDA_FAMILY=sm90 bounded 60 "$PYTHON" benchmarks/learned_bias.py --device cuda \
  --dtype bfloat16 --head-dim 64 --heads 12 --batch 4 --lengths 1024 4096 --bias head key \
  --min-run-time 0.2 --out "$LOGS/learned_bias_sm90" >"$LOGS/learned_bias_sm90.log" 2>&1
record "learned bias (sm90)" $?
pack
# The backward under deterministic algorithms: sm80's dq kernel against the Hopper family's dq in
# turns (forced: family.h, kHopperDeterministicByDefault, off until it has run on a GPU; its
# correctness is the CUDA tests' test_hopper_deterministic_backward and the harness's checks), each
# against the default algorithms, two runs' bits compared first, into the logs
# (deterministic/cuda.md and .json): what turning the Hopper one on by default would buy. Without a
# mask and with a bool one (the masked kernels' consumers wait at each query block for their turn:
# bwd_kernel.cuh, keep_turns).
note "deterministic backward"
bounded 90 "$PYTHON" benchmarks/deterministic_backward.py --device cuda --families sm80 sm90 \
  --head-dims 64 128 --lengths 4096 --masks none bool --min-run-time 0.2 --out "$LOGS/deterministic" \
  >"$LOGS/deterministic.log" 2>&1
record "deterministic backward" $?
# The fallback's deterministic backward (float32: G added by atomics in the key tiles' turns,
# fallback/turns.cuh) against its default one, into the logs (deterministic_fallback/cuda.md).
bounded 30 "$PYTHON" benchmarks/deterministic_backward.py --device cuda --families fallback \
  --dtype float32 --head-dims 64 --lengths 1024 --min-run-time 0.2 \
  --out "$LOGS/deterministic_fallback" >"$LOGS/deterministic_fallback.log" 2>&1
record "deterministic backward (fallback)" $?
pack
# The fixed cost of a call on CUDA (a tiny call back to back: the host's work and the launches per
# call, ours against SDPA), into the logs: at L = 1024 ours took 1.3-1.9x SDPA's forward on
# 2026-12-04 where the harness's kernels alone took up to 24% less time than the op's calls
# (16:16, causal), a host-side share that no other step measures.
note "call overhead"
bounded 40 "$PYTHON" benchmarks/call_overhead.py --quick >"$LOGS/call_overhead.md" 2>&1
record "call overhead" $?
pack
# The Nsight Compute profile of the default path (bf16, L = 4096, D = 128, causal: the tensor
# pipe's use and the stall reasons of each kernel, what explains the gap left), into the logs.
# NCU: the profiler (default: the machine's; found above).
if [[ -n $ncu ]]; then
  note "profile (Nsight Compute)"
  bounded 120 "$PYTHON" benchmarks/gpu_profile.py --ncu "$ncu" --out "$LOGS/profile.md" >"$LOGS/profile.log" 2>&1
  record profile $?
  pack
fi
((${#cut[@]} == 0)) || note "cut by the deadline: $(printf '%s; ' "${cut[@]}")"
note "done (results in ${OUT}), exit code ${status}"
exit "$status"
