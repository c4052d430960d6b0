# Probes of the qkv command line and its model files (label `probe`; `ctest -L probe`), included
# from tests/CMakeLists.txt when the tool is built. Seeded, bounded in count and time: each run
# of qkv has its own timeout, and a signal, a hang or an unclean exit fails the probe.
#
#   probe_model_files  300 corrupted variants of a tiny model and checkpoint, and a folder, a
#                      FIFO and a device, loaded by `qkv generate` (probe_model_files.py)
#   probe_cli          150 random flag sets of train, generate, viz, memory, scaling and bench
#                      (probe_cli.py)
#   cli_*_bounds ...   single cases of what the probes found, with the message they must print
find_program(QKV_PYTHON3 NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT QKV_PYTHON3)
  find_program(QKV_PYTHON3 python3 REQUIRED)
endif()
set(probe_dir ${CMAKE_CURRENT_BINARY_DIR}/probes)
add_test(NAME probe_model_files COMMAND ${QKV_PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/probes/probe_model_files.py
  --qkv $<TARGET_FILE:qkv_cli> --work ${probe_dir}/model_files --variants 300 --seed 1 --timeout 60)
add_test(NAME probe_cli COMMAND ${QKV_PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/probes/probe_cli.py
  --qkv $<TARGET_FILE:qkv_cli> --work ${probe_dir}/cli --runs 150 --seed 1 --timeout 60)
set_tests_properties(probe_model_files probe_cli PROPERTIES LABELS probe TIMEOUT 600
  PASS_REGULAR_EXPRESSION " 0 failures" FAIL_REGULAR_EXPRESSION "FAIL ")
# COST (seconds, roughly, under ASan + UBSan): the ASan lane's two longest tests start first under
# `ctest -j` rather than in declaration order, since a clean checkout has no timing history.
set_tests_properties(probe_model_files PROPERTIES COST 160)
set_tests_properties(probe_cli PROPERTIES COST 100)

# What the probes found, one case each (fail on the code before the fix: a segfault, a hang or
# "internal error: std::bad_alloc").
set(tiny_train train --task copy --length 3 --symbols 4 --eval 4 --d-model 8 --heads 2 --layers 1)
add_test(NAME cli_train_threads_bound COMMAND qkv_cli ${tiny_train} --steps 1 --threads 100000)
add_test(NAME cli_generate_threads_bound COMMAND qkv_cli generate --model ${probe_dir}/none.qkv --threads 100000)
add_test(NAME cli_train_lr_bound COMMAND qkv_cli ${tiny_train} --steps 1 --lr nan)
# Within the bounds, lr 10 without warm-up overflows the default model's weights in about ten steps.
# The learning rate the CLI allows at its top: whether 20 steps overflow depends on the last bits
# of the kernels' sums (ModelFile.DivergedTrainingIsAnErrorAndSavesNothingNonFinite forces it),
# so either end is right; a crash (the progress shading indexed its table with NaN) is not.
add_test(NAME cli_train_diverges COMMAND qkv_cli train --task copy --length 3 --symbols 4 --eval 4 --steps 20 --batch 2
  --warmup 0 --lr 10)
add_test(NAME cli_generate_model_is_a_folder COMMAND qkv_cli generate --model ${CMAKE_CURRENT_SOURCE_DIR})
set_tests_properties(cli_train_threads_bound cli_generate_threads_bound PROPERTIES
  PASS_REGULAR_EXPRESSION "qkv: error: --threads must be in \\[1, 1024\\], got 100000")
set_tests_properties(cli_train_lr_bound PROPERTIES PASS_REGULAR_EXPRESSION "qkv: error: --lr must be in \\[1e-09, 10\\], got nan")
set_tests_properties(cli_train_diverges PROPERTIES
  PASS_REGULAR_EXPRESSION "qkv: error: train: training diverged at step [0-9]+: .*stopped without saving|Held-out accuracy")
set_tests_properties(cli_generate_model_is_a_folder PROPERTIES
  PASS_REGULAR_EXPRESSION "qkv: error: AttentionModel::load: '.*tests': is a directory, not a model file")
set_tests_properties(cli_train_threads_bound cli_generate_threads_bound cli_train_lr_bound cli_train_diverges
  cli_generate_model_is_a_folder PROPERTIES LABELS probe TIMEOUT 60)
# Under `ulimit -f` (8 blocks of 512 bytes here, less than the model's 36 KB) the save is an
# error naming EFBIG, not death by SIGXFSZ.
add_test(NAME cli_train_save_over_file_size_limit COMMAND sh -c "ulimit -f 8 && exec \"$0\" \"$@\"" $<TARGET_FILE:qkv_cli>
  train --task copy --length 3 --symbols 4 --eval 4 --steps 1 --save ${probe_dir}/over_limit.qkv)
set_tests_properties(cli_train_save_over_file_size_limit PROPERTIES LABELS probe TIMEOUT 60
  PASS_REGULAR_EXPRESSION "qkv: error: AttentionModel::save: .*over_limit.qkv.*\\(File too large\\); the previous file, if any, is unchanged")
