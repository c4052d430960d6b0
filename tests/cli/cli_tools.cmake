# Tests of the seeing-attention tools (`qkv viz`, `qkv memory`, `qkv scaling`), included from
# tests/CMakeLists.txt when the tool is built. Small sizes: the whole set runs in a few seconds.
#
#   cli_tools_tests   GoogleTest on the drawing and arithmetic (tests/cli/test_cli_tools.cpp)
#   cli_*             the command line run for real by cli_tools_check.cmake: output files
#                     exist and are valid, numbers match hand arithmetic, bad options fail clearly

pkg_check_modules(CAIRO REQUIRED IMPORTED_TARGET cairo)
find_package(fmt CONFIG REQUIRED)
add_executable(cli_tools_tests cli/test_cli_tools.cpp
  ${PROJECT_SOURCE_DIR}/tools/qkv/plot.cpp ${PROJECT_SOURCE_DIR}/tools/qkv/numbers.cpp)
target_include_directories(cli_tools_tests PRIVATE ${PROJECT_SOURCE_DIR}/tools/qkv)
target_link_libraries(cli_tools_tests PRIVATE qkv::qkv PkgConfig::CAIRO fmt::fmt GTest::gtest_main)
gtest_discover_tests(cli_tools_tests DISCOVERY_TIMEOUT 60)

set(cli_out ${CMAKE_CURRENT_BINARY_DIR}/cli_tools)
find_program(XMLLINT xmllint)

# cli_test(name ARGS a|b|c [FILE path KIND png|svg|pdf] [EXPECT regex] [FAIL])
# Runs `qkv a b c`; FAIL means a nonzero exit is expected (and EXPECT matches its stderr).
function(cli_test name)
  cmake_parse_arguments(arg "FAIL" "ARGS;FILE;KIND;EXPECT" "" ${ARGN})
  add_test(NAME ${name} COMMAND ${CMAKE_COMMAND}
    -DQKV=$<TARGET_FILE:qkv_cli> "-DARGS=${arg_ARGS}" -DFILE=${arg_FILE} -DKIND=${arg_KIND}
    "-DEXPECT=${arg_EXPECT}" -DFAIL=${arg_FAIL} -DXMLLINT=${XMLLINT} -DWORK_DIR=${cli_out}
    -P ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_tools_check.cmake)
  set_tests_properties(${name} PROPERTIES TIMEOUT 60)
endfunction()

# qkv viz: each format, each figure kind.
cli_test(cli_viz_png ARGS "viz|--text|The cat sat on the mat|-o|${cli_out}/heads.png"
  FILE ${cli_out}/heads.png KIND png EXPECT "9 panels, 6 tokens")
cli_test(cli_viz_causal_svg ARGS "viz|--causal|--heads|2|--embed|16|-o|${cli_out}/causal.svg"
  FILE ${cli_out}/causal.svg KIND svg EXPECT "3 panels")
cli_test(cli_viz_pdf ARGS "viz|--heads|1|--embed|8|-o|${cli_out}/one.pdf" FILE ${cli_out}/one.pdf KIND pdf)
cli_test(cli_viz_temperature ARGS "viz|--temperature|0.5,1,2|-o|${cli_out}/temperature.png"
  FILE ${cli_out}/temperature.png KIND png EXPECT "3 panels")
cli_test(cli_viz_compare_heads ARGS "viz|--compare-heads|1,8|--chars|--text|attend|-o|${cli_out}/compare.png"
  FILE ${cli_out}/compare.png KIND png EXPECT "10 panels, 6 tokens")
# Bad options: a clear message and a nonzero exit.
cli_test(cli_viz_sparse_mask ARGS "viz|--chars|--text|abcdefghijklmnopqrstuvwxyz|--heads|2|--embed|16|--mask|causal & strided(3)|-o|${cli_out}/sparse.png"
  FILE ${cli_out}/sparse.png KIND png EXPECT "4 panels, 26 tokens")
cli_test(cli_viz_bad_mask ARGS "viz|--mask|causal & strided(0)|-o|${cli_out}/x.png" FAIL
  EXPECT "mask 'causal & strided\\(0\\)': column 18, found '0': strided's stride must be at least 1")
cli_test(cli_viz_empty_text ARGS "viz|--text|   |-o|${cli_out}/x.png" FAIL EXPECT "--text is empty")
cli_test(cli_viz_negative_heads ARGS "viz|--heads|-2|-o|${cli_out}/x.png" FAIL EXPECT "--heads must be positive, got -2")
cli_test(cli_viz_bad_extension ARGS "viz|-o|${cli_out}/x.jpg" FAIL EXPECT "unknown extension '.jpg'; use .png, .svg or .pdf")
cli_test(cli_viz_indivisible ARGS "viz|--heads|7|--embed|64" FAIL EXPECT "embed_dim \\(64\\) must be divisible by num_heads \\(7\\)")
cli_test(cli_viz_bad_temperature ARGS "viz|--temperature|0,1" FAIL EXPECT "--temperature values must be positive")
# qkv viz --model: a tiny model trained first (fixture viz_model), then its heads drawn.
file(MAKE_DIRECTORY ${cli_out})
add_test(NAME cli_viz_model_train COMMAND qkv_cli train --task copy --length 3 --symbols 4 --steps 20 --eval 16
  --save ${cli_out}/tiny.qkv)
set_tests_properties(cli_viz_model_train PROPERTIES FIXTURES_SETUP viz_model TIMEOUT 60
  PASS_REGULAR_EXPRESSION "Saved the model to")
cli_test(cli_viz_model ARGS "viz|--model|${cli_out}/tiny.qkv|-o|${cli_out}/trained.png"
  FILE ${cli_out}/trained.png KIND png EXPECT "10 panels, 2 layers of 4 heads, 6 tokens, task copy")
cli_test(cli_viz_model_text ARGS "viz|--model|${cli_out}/tiny.qkv|--text|b a d c|-o|${cli_out}/trained.svg"
  FILE ${cli_out}/trained.svg KIND svg EXPECT "10 panels, 2 layers of 4 heads, 4 tokens")
cli_test(cli_viz_model_heads ARGS "viz|--model|${cli_out}/tiny.qkv|--heads|2" FAIL
  EXPECT "--heads describes the untrained layer; with --model the layers come from the file")
set_tests_properties(cli_viz_model cli_viz_model_text cli_viz_model_heads PROPERTIES FIXTURES_REQUIRED viz_model)
# qkv generate: the tiny copy model generates from its cache (f32, bf16) and without it; --sweep
# and --plot time both to a position past the trained length.
cli_test(cli_generate ARGS "generate|--model|${cli_out}/tiny.qkv"
  EXPECT "prompt: .*\\|.*generated: .*expected: .*of 3 right.*[0-9]+ tokens/s \\(KV cache in f32")
cli_test(cli_generate_bf16 ARGS "generate|--model|${cli_out}/tiny.qkv|--prompt|a b c a d|--tokens|1|--kv-dtype|bf16"
  EXPECT "prompt: +a b c a d.*1 tokens in .*KV cache in bf16")
cli_test(cli_generate_no_cache ARGS "generate|--model|${cli_out}/tiny.qkv|--prompt|0 1 4|--no-cache"
  EXPECT "prompt: +a b \\|.*no cache: the prefix recomputed at every step")
cli_test(cli_generate_plot ARGS "generate|--model|${cli_out}/tiny.qkv|--sweep|64|--repeats|1|--plot|${cli_out}/generation.svg"
  FILE ${cli_out}/generation.svg KIND svg EXPECT "log-log slope of the attention time per token from position 16 to 64: cached [-0-9.]+, recomputed [-0-9.]+.*at position 64: the cache makes")
cli_test(cli_generate_bad_prompt ARGS "generate|--model|${cli_out}/tiny.qkv|--prompt|a z" FAIL
  EXPECT "--prompt: 'z' is not a token of this model: give ids 0 to 4 or its letters a to d and '\\|'")
cli_test(cli_generate_too_long ARGS "generate|--model|${cli_out}/tiny.qkv|--tokens|9" FAIL
  EXPECT "need 12 positions, but the model reads at most max_len 6")
set_tests_properties(cli_generate cli_generate_bf16 cli_generate_no_cache cli_generate_plot cli_generate_bad_prompt
  cli_generate_too_long PROPERTIES FIXTURES_REQUIRED viz_model)
# qkv viz --model on a sparse and a linear model (trained by tests/CMakeLists.txt's cli_train_sparse
# and cli_train_linear): the mask is honoured, linear heads are drawn from phi(q).phi(k).
cli_test(cli_viz_model_sparse ARGS "viz|--model|${CMAKE_CURRENT_BINARY_DIR}/cli_train_sparse.qkv|-o|${cli_out}/sparse_model.png"
  FILE ${cli_out}/sparse_model.png KIND png EXPECT "10 panels, 2 layers of 4 heads, 8 tokens, task copy, softmax attention, mask causal & \\(window\\(3\\) \\| strided\\(4\\)\\)")
cli_test(cli_viz_model_linear ARGS "viz|--model|${CMAKE_CURRENT_BINARY_DIR}/cli_train_linear.qkv|-o|${cli_out}/linear_model.png"
  FILE ${cli_out}/linear_model.png KIND png EXPECT "10 panels, 2 layers of 4 heads, 6 tokens, task copy, linear attention")
# qkv generate on the sparse model: its mask moves with the cache.
cli_test(cli_generate_sparse ARGS "generate|--model|${CMAKE_CURRENT_BINARY_DIR}/cli_train_sparse.qkv|--kv-dtype|f16"
  EXPECT "softmax attention, rotary positions, mask window\\(3\\) \\| strided\\(4\\).*tokens/s \\(KV cache in f16")
set_tests_properties(cli_generate_sparse PROPERTIES DEPENDS cli_train_sparse FIXTURES_REQUIRED train_sparse)
set_tests_properties(cli_viz_model_sparse PROPERTIES DEPENDS cli_train_sparse FIXTURES_REQUIRED train_sparse)
set_tests_properties(cli_viz_model_linear PROPERTIES DEPENDS cli_train_linear FIXTURES_REQUIRED train_linear)
cli_test(cli_viz_model_missing ARGS "viz|--model|${cli_out}/no-such-model.qkv|-o|${cli_out}/x.png" FAIL
  EXPECT "qkv: error: AttentionModel::load: cannot open '.*no-such-model.qkv'")
cli_test(cli_viz_model_corrupt ARGS "viz|--model|${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_tools.cmake|-o|${cli_out}/x.png" FAIL
  EXPECT "qkv: error: AttentionModel::load: .*cli_tools.cmake.*not a qkv model file")

# qkv memory: the course's GPT-3 case and an odd one, checked against arithmetic done here.
cli_test(cli_memory_gpt3 ARGS "memory|--seq|2048|--layers|96|--heads|96|--batch|1|--dtype|f32"
  EXPECT "MEMORY:2048:96:96:1:4")
cli_test(cli_memory_f16 ARGS "memory|--seq|1000|--layers|3|--heads|5|--batch|2|--dtype|f16|--training"
  EXPECT "MEMORY:1000:3:5:2:2")
cli_test(cli_memory_negative ARGS "memory|--seq|-5" FAIL EXPECT "--seq must be positive, got -5")
cli_test(cli_memory_bad_dtype ARGS "memory|--dtype|f8" FAIL EXPECT "unknown --dtype 'f8'")

# qkv scaling: three tiny sizes, one timed call each. The reference's scratch is its N x N
# scores, plus from N = 256 the Tiled GEMM path's packed panels of V (N x d, src/gemm/tiled.cpp):
# a slope of 2.00-2.09 at these sizes.
cli_test(cli_scaling ARGS "scaling|--min-seq|64|--max-seq|256|--heads|2|--head-dim|16|--repeats|1|-o|${cli_out}/scaling.svg"
  FILE ${cli_out}/scaling.svg KIND svg EXPECT "log-log slopes.*scratch reference 2.0[0-9]")
# --linear (the older spelling of --kernels ...,linear): linear's time and slope beside flash.
# Time slopes from one call per point can come out negative on a busy machine (CI saw
# linear -0.08 under the sanitizers): the regexes check that they are printed, not their value.
cli_test(cli_scaling_linear ARGS "scaling|--min-seq|64|--max-seq|256|--heads|2|--head-dim|16|--repeats|1|--linear|-o|${cli_out}/scaling_linear.svg"
  FILE ${cli_out}/scaling_linear.svg KIND svg
  EXPECT "kernels reference, flash, linear.*time reference -?[0-9.]+, flash -?[0-9.]+, linear -?[0-9.]+. scratch.*(crossover: linear|linear does not overtake flash)")
# All four kernels, causal, W = 32: the sparse mask's visible pairs per head match hand
# arithmetic (query i sees min(i, 31) + 1 window keys and floor(i / 32) - 0 strided ones beyond
# it: 528 + 32 (N - 32) + 32 (1 + ... + (N / 32 - 1))), and each of sparse and linear gets a crossover line.
cli_test(cli_scaling_kernels ARGS "scaling|--kernels|linear,sparse,flash,reference|--causal|--sparse-window|32|--min-seq|64|--max-seq|256|--heads|2|--head-dim|16|--repeats|1|-o|${cli_out}/scaling_kernels.svg"
  FILE ${cli_out}/scaling_kernels.svg KIND svg
  EXPECT "causal. kernels reference, flash, sparse, linear.*under the mask causal & \\(window\\(31\\) \\| strided\\(32\\)\\) \\(window \\+ stride W = 32\\).*time reference -?[0-9.]+, flash -?[0-9.]+, sparse -?[0-9.]+, linear -?[0-9.]+. scratch.*pairs per head: 1584 at N = 64, 3792 at N = 128, 8592 at N = 256. slope.*(crossover: sparse|sparse does not overtake flash).*(crossover: linear|linear does not overtake flash)")
# --sparse-mask: any expression, parsed; an unmasked flash against a causal sparse mask says so.
# (No ';' in these regexes: CMake would split the argument there.) causal & window(15): 16 N - 120 pairs.
cli_test(cli_scaling_sparse_mask ARGS "scaling|--kernels|flash,sparse|--sparse-mask|causal & window(15)|--min-seq|64|--max-seq|128|--heads|1|--head-dim|8|--repeats|1|-o|${cli_out}/scaling_mask.svg"
  FILE ${cli_out}/scaling_mask.svg KIND svg
  EXPECT "under the mask causal & window\\(15\\) \\(--sparse-mask\\).*pairs per head: 904 at N = 64, 1928 at N = 128. slope.*note: sparse's mask is causal but the other kernels run unmasked: add --causal")
# --clock cpu: the process's CPU time, said in the header.
cli_test(cli_scaling_cpu_clock ARGS "scaling|--clock|cpu|--min-seq|64|--max-seq|128|--heads|1|--head-dim|8|--repeats|1|-o|${cli_out}/scaling_cpu.svg"
  FILE ${cli_out}/scaling_cpu.svg KIND svg EXPECT "time: the process's CPU time on [0-9]+ OpenMP thread")
cli_test(cli_scaling_bad_clock ARGS "scaling|--clock|sundial" FAIL EXPECT "--clock: sundial not in")
cli_test(cli_scaling_bad_kernel ARGS "scaling|--kernels|flash,sparce" FAIL
  EXPECT "unknown kernel 'sparce' in --kernels 'flash,sparce': choose from reference, flash, sparse, linear")
cli_test(cli_scaling_bad_sparse_mask ARGS "scaling|--kernels|sparse|--sparse-mask|causal & strided(0)" FAIL EXPECT "strided")
cli_test(cli_scaling_bad_sparse_window ARGS "scaling|--kernels|sparse|--sparse-window|0" FAIL
  EXPECT "--sparse-window must be at least 1, got 0")
cli_test(cli_scaling_mask_and_window ARGS "scaling|--sparse-window|64|--sparse-mask|causal" FAIL EXPECT "excludes")
cli_test(cli_scaling_budget ARGS "scaling|--min-seq|64|--max-seq|256|--max-mem|1K" FAIL
  EXPECT "stopped before N = 64: it would need about .* over the 1 KiB budget")
cli_test(cli_scaling_bad_range ARGS "scaling|--min-seq|512|--max-seq|256" FAIL EXPECT "--max-seq \\(256\\) must be at least --min-seq \\(512\\)")
cli_test(cli_scaling_bad_max_mem ARGS "scaling|--max-mem|lots" FAIL EXPECT "--max-mem 'lots' is not a positive size")
cli_test(cli_scaling_bad_extension ARGS "scaling|-o|${cli_out}/plot.gif" FAIL EXPECT "unknown extension '.gif'")
