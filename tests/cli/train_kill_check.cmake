# qkv train checkpoints survive a crash in the middle of a save, and Ctrl-C saves one.
#   1. A run that checkpoints every 4 steps is SIGKILLed halfway through writing its second
#      checkpoint (the library's test hook QKV_TEST_KILL_IN_SAVE, src/train/model_file.cpp).
#   2. The first checkpoint is intact: --resume reads it (checksum and all) at step 4, and the
#      resumed run ends with exactly the model an uninterrupted run saves.
#   3. SIGINT (what Ctrl-C sends) to a long run: it saves a checkpoint and exits with 130.
# Run as: cmake -DQKV=<qkv binary> -DWORK_DIR=<scratch folder> -P train_kill_check.cmake
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(ckpt ${WORK_DIR}/run.ckpt)
set(train ${QKV} train --task copy --length 3 --symbols 4 --steps 12 --batch 8 --d-model 16 --heads 2 --layers 1
    --eval 8 --eval-every 100)

# 1. Killed inside the second save.
execute_process(COMMAND ${CMAKE_COMMAND} -E env QKV_TEST_KILL_IN_SAVE=2 ${train} --checkpoint ${ckpt} --checkpoint-every 4
  RESULT_VARIABLE killed OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(killed EQUAL 0 OR NOT EXISTS ${ckpt})
  message(FATAL_ERROR "the run should have died in its second save (result '${killed}') after writing ${ckpt}\n${out}\n${err}")
endif()
file(GLOB partial ${ckpt}.tmp-*)
if(NOT partial)
  message(FATAL_ERROR "no half-written temporary file beside ${ckpt}: the kill did not happen mid-save")
endif()
file(SIZE ${ckpt} whole_size)
list(GET partial 0 partial_file)
file(SIZE ${partial_file} partial_size)
message(STATUS "killed mid-save (${killed}): ${ckpt} has ${whole_size} bytes, the torn temporary ${partial_size}")

# 2. The previous checkpoint is whole: resume from it and finish; compare with a straight run.
execute_process(COMMAND ${train} --checkpoint ${ckpt} --checkpoint-every 4 --resume --save ${WORK_DIR}/resumed.qkv
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0 OR NOT out MATCHES "Resumed from [^\n]*run.ckpt at step 4 of 12")
  message(FATAL_ERROR "resuming from the surviving checkpoint failed (${result}):\n${out}\n${err}")
endif()
execute_process(COMMAND ${train} --checkpoint ${WORK_DIR}/unused.ckpt --save ${WORK_DIR}/straight.qkv
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "the uninterrupted run failed (${result}):\n${out}\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${WORK_DIR}/resumed.qkv ${WORK_DIR}/straight.qkv
  RESULT_VARIABLE differ)
if(NOT differ EQUAL 0)
  message(FATAL_ERROR "the resumed run's model differs from the uninterrupted run's")
endif()

# 3. Ctrl-C: once the run has printed its header (the SIGINT handler is in place by then), send
#    SIGINT to a run far too long to finish, as a terminal's Ctrl-C would.
set(interrupted_ckpt ${WORK_DIR}/interrupted.ckpt)
set(script "
  '${QKV}' train --task copy --length 3 --symbols 4 --steps 100000000 --batch 8 --d-model 16 --heads 2 \\
      --layers 1 --eval-every 100000000 --checkpoint '${interrupted_ckpt}' >'${WORK_DIR}/out.txt' 2>'${WORK_DIR}/err.txt' &
  pid=$!
  for i in $(seq 600); do grep -q 'held-out' '${WORK_DIR}/out.txt' && break; sleep 0.1; done
  sleep 0.5
  kill -INT $pid
  wait $pid")
execute_process(COMMAND sh -c "${script}" RESULT_VARIABLE result)
file(READ ${WORK_DIR}/err.txt err)
if(NOT result EQUAL 130 OR NOT EXISTS ${interrupted_ckpt} OR NOT err MATCHES "Interrupted: saved a checkpoint at step [0-9]+ to")
  message(FATAL_ERROR "SIGINT did not save a checkpoint and exit with 130 (result ${result}):\n${err}")
endif()
message(STATUS "Ctrl-C: ${err}")
