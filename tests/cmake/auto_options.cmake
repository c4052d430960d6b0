# The Python module and qkv::dist appear once their dependencies do: a configure with pybind11
# and MPI made unfindable builds neither, and a reconfigure of the same tree with them visible
# (as after `make demo`, then `make test` installing them) builds both, the cache holding AUTO,
# never a stale OFF. Only the configure runs; the targets are read from the generated build.
# Run as: cmake -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch> -DCXX_COMPILER=<c++> -P auto_options.cmake
file(REMOVE_RECURSE ${WORK_DIR})
set(common -S ${SOURCE_DIR} -B ${WORK_DIR} -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
  -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_TOOLS=OFF -DQKV_BUILD_BENCHMARKS=OFF)

# targets_of(out): the target names of the configured tree.
function(targets_of out)
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR} --target help
    RESULT_VARIABLE result OUTPUT_VARIABLE listing ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "listing the targets failed (${result}): ${err}")
  endif()
  set(${out} "${listing}" PARENT_SCOPE)
endfunction()

function(configure)
  execute_process(COMMAND ${CMAKE_COMMAND} ${common} ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out
    ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "configure ${ARGN} failed (${result}):\n${out}\n${err}")
  endif()
endfunction()

configure(-DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
targets_of(before)
foreach(target qkv_python_core qkv_dist)
  string(FIND "${before}" "${target}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "${target} is built though its dependencies were hidden")
  endif()
endforeach()

configure(-DCMAKE_DISABLE_FIND_PACKAGE_pybind11=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=OFF)
targets_of(after)
foreach(target qkv_python_core qkv_dist)
  string(FIND "${after}" "${target}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${target} did not appear on the reconfigure with its dependencies visible")
  endif()
endforeach()
file(STRINGS ${WORK_DIR}/CMakeCache.txt cached REGEX "^QKV_BUILD_(PYTHON|DIST):")
message(STATUS "the module and qkv::dist appeared on the reconfigure; cache: ${cached}")
