# Installs the built qkv into a scratch prefix, then configures, builds and runs
# tests/consumer against it, as a user's own project would.
file(REMOVE_RECURSE ${WORK_DIR})
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "consumer test: step failed (${result}): ${ARGN}")
  endif()
endfunction()
step(${CMAKE_COMMAND} --install ${QKV_BUILD_DIR} --prefix ${WORK_DIR}/prefix)
step(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build
     -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release)
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step(${WORK_DIR}/build/consumer)

# The installed tool runs from its prefix (its RPATH finds libqkv there), and qkv/dist.hpp is
# installed exactly when libqkv_dist is.
if(WITH_TOOL)
  execute_process(COMMAND ${WORK_DIR}/prefix/bin/qkv --version RESULT_VARIABLE result OUTPUT_VARIABLE out
    ERROR_VARIABLE err)
  if(NOT result EQUAL 0 OR NOT out MATCHES "qkv ${VERSION}")
    message(FATAL_ERROR "the installed qkv --version failed (${result}): ${out}${err}")
  endif()
endif()
file(GLOB dist_libraries ${WORK_DIR}/prefix/lib*/libqkv_dist* ${WORK_DIR}/prefix/lib*/*/libqkv_dist*)
set(has_header OFF)
if(EXISTS ${WORK_DIR}/prefix/include/qkv/dist.hpp)
  set(has_header ON)
endif()
if(dist_libraries AND NOT has_header)
  message(FATAL_ERROR "libqkv_dist is installed without qkv/dist.hpp")
elseif(has_header AND NOT dist_libraries)
  message(FATAL_ERROR "qkv/dist.hpp is installed without libqkv_dist")
elseif(WITH_DIST AND NOT dist_libraries)
  message(FATAL_ERROR "qkv::dist was built but not installed")
endif()
message(STATUS "installed qkv runs; dist.hpp installed with its library: ${has_header}")
