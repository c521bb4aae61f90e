#!/usr/bin/env bash
# One call on the lent GPU (no nox there): the GPU suites and/or the benchmarks, sources on
# PYTHONPATH, the compiled hot paths required. Writes logs and JSON under $OUT (default
# results/) and prints short tables last.
#
#   bash benchmarks/device_session.sh [tests|bench|main|targets|sanitizer|all]
#
# main: the main job alone (benchmarks/decode_bench.py); sanitizer: the GPU suites of the
# publication path under compute-sanitizer's memcheck, racecheck and synccheck (not part of
# "all"; H2D_SANITIZER_TOOLS and H2D_SANITIZER_TIMEOUT narrow them).
#
# targets: benchmarks/step_targets.py, v41_step.py and mtp_step.py (the peers they compare
# against are re-created in benchmarks/peers: nothing outside the checkout is needed).
#
# H2D_BENCH_CPU=N runs the benchmarks pinned to CPU core N (taskset), as an engine pins its
# scheduler thread; unset, they run wherever the OS puts them.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=packages/block-tables/src:packages/h2d-kernels/src:packages/h2d-core/src:packages/h2d-runner-adapters/src
# the compiled helpers, built in place (installed wheels carry them; a checkout does not)
python3 tools/build_native.py || exit 1
out="${OUT:-results}"
mkdir -p "$out"
what="${1:-all}"
pin=()
if [[ -n "${H2D_BENCH_CPU:-}" ]]; then pin=(taskset -c "$H2D_BENCH_CPU"); fi
tag="${H2D_BENCH_CPU:+.cpu$H2D_BENCH_CPU}"
python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name())"
if [[ $what == tests || $what == all ]]; then
  RUN_H2D_GPU_TESTS=1 python3 -m pytest -rfE packages tests-integration >"$out/gpu_tests.log" 2>&1
  echo "gpu suites: exit $?"; tail -n 15 "$out/gpu_tests.log"
fi
if [[ $what == targets || $what == all ]]; then
  "${pin[@]}" python3 benchmarks/step_targets.py --out "$out" \
    >"$out/step_targets$tag.log" 2>&1
  echo "step_targets: exit $?"; tail -n 8 "$out/step_targets$tag.log"
  "${pin[@]}" python3 benchmarks/v41_step.py --out "$out" >"$out/v41_step$tag.log" 2>&1
  echo "v41_step: exit $?"; tail -n 7 "$out/v41_step$tag.log"
  for mtp in "--k 1" "--k 3" "--k 1 --gdn"; do
    log="$out/mtp_step${mtp// /}$tag.log"
    "${pin[@]}" python3 benchmarks/mtp_step.py $mtp --out "$out" >"$log" 2>&1
    echo "mtp_step $mtp: exit $?"; tail -n 7 "$log"
  done
fi
if [[ $what == sanitizer ]]; then
  # The publication path's GPU cases: arena, scatter, packed groups, the core's publication
  # and launch paths (fault injection included), the first consumers, the fused step. The
  # profiler-trace tests are left out: CUPTI takes one subscriber, the sanitizer.
  suites=(packages/h2d-kernels/tests packages/h2d-core/tests/test_h2d_publication.py
          packages/h2d-core/tests/test_packed_h2d.py packages/h2d-core/tests/test_compiled_launch.py
          packages/h2d-core/tests/test_fault_injection_cuda.py
          packages/h2d-runner-adapters/tests/test_consumers.py
          packages/h2d-runner-adapters/tests/test_decode_step.py)
  if [[ -n "${H2D_SANITIZER_SUITES:-}" ]]; then read -r -a suites <<<"$H2D_SANITIZER_SUITES"; fi
  for tool in ${H2D_SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
    log="$out/sanitizer_$tool.log"
    RUN_H2D_GPU_TESTS=1 timeout "${H2D_SANITIZER_TIMEOUT:-170}" compute-sanitizer \
      --tool "$tool" --error-exitcode 86 --print-limit 20 \
      python3 -m pytest -q -rfE -p no:cacheprovider -k "(cuda or gpu or not cpu) and not profiler" "${suites[@]}" \
      >"$log" 2>&1
    echo "compute-sanitizer $tool: exit $? (86: errors found, 124: time limit)"
    grep -E "SUMMARY|passed|failed|^FAILED|^ERROR" "$log" | tail -n 8
  done
fi
if [[ $what == main ]]; then
  "${pin[@]}" timeout "${H2D_MAIN_TIMEOUT:-420}" python3 benchmarks/decode_bench.py \
    --out "$out" >"$out/decode_bench$tag.log" 2>&1
  echo "decode_bench: exit $?"; grep -E "^(mha|v41|mtp|gdn) bs=" "$out/decode_bench$tag.log"
fi
if [[ $what == bench || $what == all ]]; then
  "${pin[@]}" python3 benchmarks/publication_bench.py all --out "$out" --steps 300 \
    >"$out/publication_bench$tag.log" 2>&1
  echo "publication_bench: exit $?"; grep -A 40 "^core:" "$out/publication_bench$tag.log"
  "${pin[@]}" python3 benchmarks/decode_bench.py --out "$out" >"$out/decode_bench$tag.log" 2>&1
  echo "decode_bench: exit $?"; tail -n 14 "$out/decode_bench$tag.log"
fi
