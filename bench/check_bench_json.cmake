# ctest smoke test of `qkv bench --json`: runs the fastest workload once and checks that every
# line is a JSON object with the keys its kind promises. It never looks at a speed: speed is
# measured by `qkv bench` and bench/, not asserted by timed tests.
#   cmake -DQKV=path/to/qkv -P check_bench_json.cmake
cmake_policy(SET CMP0054 NEW)  # "workload" below is a string, not the variable of that name
execute_process(COMMAND ${QKV} bench --workload W5 --runs 1 --no-reference --json
  OUTPUT_VARIABLE output ERROR_VARIABLE errors RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "qkv bench exited with ${status}\n${errors}")
endif()

set(environment_keys qkv_version omp_threads openblas_threads openblas_coretype openblas_core decode_built
  fma_peak_gflops fma_lanes simd_target sgemm_gflops sgemm_library sgemm_openblas_gflops sgemm_onednn_gflops
  memcpy_gbs read_gbs read_plain_gbs read_prefetch_gbs read_threads read_gbs_start read_gbs_end warnings)
set(gemm_keys class trans_a trans_b m n k gflops chosen chosen_gflops vs_best_path vs_sgemm vs_peak)
set(workload_keys workload backend kernel shape mask runs first_ms median_ms min_ms calls_per_s gflops gbs
  vs_reference vs_sgemm vs_peak vs_memcpy vs_read peak_extra_mib)

string(STRIP "${output}" output)
string(REPLACE "\n" ";" lines "${output}")
set(kinds "")
foreach(line IN LISTS lines)
  string(JSON kind ERROR_VARIABLE json_error GET "${line}" kind)
  if(json_error)
    message(FATAL_ERROR "not a JSON object with a kind: ${line}\n${json_error}")
  endif()
  list(APPEND kinds ${kind})
  if(kind STREQUAL "environment")
    set(keys ${environment_keys})
  elseif(kind STREQUAL "workload")
    set(keys ${workload_keys})
  elseif(kind STREQUAL "gemm")
    set(keys ${gemm_keys})
  else()
    set(keys "")
  endif()
  foreach(key IN LISTS keys)
    string(JSON type ERROR_VARIABLE json_error TYPE "${line}" ${key})
    if(json_error)
      message(FATAL_ERROR "${kind} line has no key '${key}': ${line}")
    endif()
  endforeach()
  if(kind STREQUAL "environment")
    # The read ceiling read something: a probe whose loop was skipped would report 0.
    string(JSON read_gbs GET "${line}" read_gbs)
    string(JSON read_threads GET "${line}" read_threads)
    if(NOT read_gbs GREATER 0 OR NOT read_threads GREATER 0)
      message(FATAL_ERROR "expected a positive read ceiling and thread count: ${line}")
    endif()
  endif()
  if(kind STREQUAL "workload")
    string(JSON workload GET "${line}" workload)
    string(JSON median_ms GET "${line}" median_ms)
    string(JSON runs GET "${line}" runs)
    string(JSON vs_reference TYPE "${line}" vs_reference)
    if(NOT workload STREQUAL "W5" OR NOT runs EQUAL 1 OR NOT vs_reference STREQUAL "NULL" OR NOT median_ms GREATER 0)
      message(FATAL_ERROR "expected W5, 1 run, no reference and a positive time: ${line}")
    endif()
  endif()
endforeach()
# The environment, the GEMM paths' shape classes (at least one), the one workload, then the
# targets measured (the GEMM classes' among them).
string(REPLACE ";" " " kind_text "${kinds}")
if(NOT kind_text MATCHES "^environment( gemm)+ workload( target)*$")
  message(FATAL_ERROR "expected an environment line, gemm lines, then one workload line, got kinds: ${kinds}\n${output}")
endif()
message(STATUS "qkv bench --json: OK (${kinds})")
