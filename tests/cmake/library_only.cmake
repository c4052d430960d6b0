# The library alone configures with only the library's dependencies: a fresh configure of the
# source tree with tests, tools and Python off, and every package that only tests, tools or
# Python use made unfindable (CMAKE_DISABLE_FIND_PACKAGE_<name>): if anything still asked for
# one of them, the configure would fail. It then builds one object of the library (a full
# library build is the same compiler and flags, at minutes of CI time; checked by hand, see
# docs/reliability.md).
# Run as: cmake -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch folder> -DCXX_COMPILER=<c++> -P library_only.cmake
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_TOOLS=OFF -DQKV_BUILD_PYTHON=OFF
    -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON
    -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=ON -DCMAKE_DISABLE_FIND_PACKAGE_fmt=ON
    -DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON -DCMAKE_DISABLE_FIND_PACKAGE_Python3=ON
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "library-only configure failed (${result}):\n${out}\n${err}")
endif()
foreach(unwanted GTest benchmark CLI11 fmt pybind11 cairo)
  file(STRINGS ${WORK_DIR}/CMakeCache.txt found REGEX "^${unwanted}_DIR:PATH=/|^CAIRO_FOUND")
  if(found)
    message(FATAL_ERROR "the library-only configure looked for ${unwanted}: ${found}")
  endif()
endforeach()
# Build the smallest real object of the library, proving the generated build works.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR} --target src/core/version.cpp.o
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "building an object of the library-only tree failed (${result}):\n${out}\n${err}")
endif()
message(STATUS "library-only configure and build of src/core/version.cpp.o: fine")
