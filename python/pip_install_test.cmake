# `pip install --no-build-isolation .` as a new user runs it: a copy of the source tree as a fresh
# clone has it (git's tracked and untracked-but-not-ignored files, nothing of any build), a new
# virtualenv made outside it with --system-site-packages (Debian's numpy, setuptools, wheel), pip
# with --no-index (offline), then the venv's python imports qkv from another folder and runs it.
# Skipped (ctest SKIP_REGULAR_EXPRESSION "SKIP:") when the venv cannot be made (no python3-venv).
# Run as: cmake -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch> -DPYTHON=<python3> -P pip_install_test.cmake
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/clone ${WORK_DIR}/elsewhere)

# The fresh clone.
execute_process(COMMAND git -C ${SOURCE_DIR} ls-files -co --exclude-standard
  OUTPUT_VARIABLE files RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "git ls-files failed in ${SOURCE_DIR} (${result})")
endif()
string(REPLACE "\n" ";" files "${files}")
foreach(f IN LISTS files)
  if(f AND EXISTS ${SOURCE_DIR}/${f} AND NOT IS_DIRECTORY ${SOURCE_DIR}/${f})
    get_filename_component(dir ${f} DIRECTORY)
    file(COPY ${SOURCE_DIR}/${f} DESTINATION ${WORK_DIR}/clone/${dir})
  endif()
endforeach()

execute_process(COMMAND ${PYTHON} -m venv --system-site-packages ${WORK_DIR}/venv
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0 OR NOT EXISTS ${WORK_DIR}/venv/bin/pip)
  message("SKIP: cannot make a virtualenv with pip (${result}): apt-get install python3-venv python3-pip\n${err}")
  return()
endif()

# The build compiles the kernels for one SIMD target, Highway's SSSE3 (its x86-64-v2 baseline:
# without -mpclmul -maes Highway 1.0.3 does not count it SSE4), through the user's knob
# QKV_CMAKE_ARGS: what this test checks is the packaging (setup.py driving CMake, the install,
# the import from elsewhere), and the release suite already runs every target's kernels; with
# all of Highway's targets this build was the release lane's longest test. Elsewhere than x86-64
# the flags are left alone.
set(pip_cmake_args "")
cmake_host_system_information(RESULT arch QUERY OS_PLATFORM)  # script mode sets no CMAKE_HOST_SYSTEM_PROCESSOR
if(arch MATCHES "^(x86_64|AMD64)$")
  set(pip_cmake_args "QKV_CMAKE_ARGS='-DCMAKE_CXX_FLAGS=-march=x86-64-v2 -DHWY_COMPILE_ONLY_STATIC'")
endif()
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env CMAKE_BUILD_PARALLEL_LEVEL=2 PIP_DISABLE_PIP_VERSION_CHECK=1 ${pip_cmake_args}
    ${WORK_DIR}/venv/bin/pip install --no-build-isolation --no-index ${WORK_DIR}/clone
  WORKING_DIRECTORY ${WORK_DIR}/elsewhere
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "pip install --no-build-isolation failed (${result}):\n${out}\n${err}")
endif()

file(WRITE ${WORK_DIR}/elsewhere/check.py "
import sys
import numpy as np
import qkv
assert qkv.__file__.startswith(sys.prefix + '/'), (qkv.__file__, sys.prefix)
assert '/clone/' not in qkv.__file__, qkv.__file__
x = np.ones((2, 3, 4), np.float32)
out = qkv.scaled_dot_product_attention(x, x, x, is_causal=True)
assert out.shape == (2, 3, 4) and out.dtype == np.float32
assert np.allclose(out, 1.0), out  # equal values average to themselves
print('pip-installed qkv', qkv.__version__, 'imported from', qkv.__file__)
")
execute_process(COMMAND ${CMAKE_COMMAND} -E env PYTHONDONTWRITEBYTECODE=1 --unset=PYTHONPATH
    ${WORK_DIR}/venv/bin/python ${WORK_DIR}/elsewhere/check.py
  WORKING_DIRECTORY ${WORK_DIR}/elsewhere
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "the venv's python could not use the installed qkv (${result}):\n${out}\n${err}")
endif()
message(STATUS "${out}")
