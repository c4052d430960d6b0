# Finds what the Python module needs and sets QKV_PYTHON_FOUND, the default of QKV_BUILD_PYTHON.
# Included from the top-level CMakeLists.txt before the option is declared.
#
# The interpreter: the first python3 on PATH that can import numpy (the module's one runtime
# dependency), i.e. the one the user runs - an activated virtualenv, pyenv, or /usr/bin/python3 -
# unless named with -DPython3_EXECUTABLE=... Earlier python3s without numpy (a bare pyenv build,
# say) are passed over, and the configure log says which interpreter was taken and which were
# passed over. The tests also need pytest and torch importable from it (a virtualenv made with
# --system-site-packages sees Debian's python3-numpy, -pytest and -torch).
set(QKV_PYTHON_FOUND OFF)
if(QKV_SANITIZE OR QKV_TSAN OR QKV_FUZZ)
  # An extension module under a sanitizer needs its runtime preloaded into python3.
  return()
endif()
if(DEFINED Python3_EXECUTABLE)
  set(qkv_python_why "named with -DPython3_EXECUTABLE")
else()
  set(qkv_python_why "found by FindPython3: no python3 on PATH imports numpy")
  set(qkv_passed_over "")
  string(REPLACE ":" ";" qkv_path "$ENV{PATH}")
  foreach(dir IN LISTS qkv_path)
    if(dir AND EXISTS "${dir}/python3" AND NOT IS_DIRECTORY "${dir}/python3")
      execute_process(COMMAND "${dir}/python3" -c "import numpy" RESULT_VARIABLE has_numpy OUTPUT_QUIET ERROR_QUIET)
      if(has_numpy EQUAL 0)
        set(Python3_EXECUTABLE "${dir}/python3")
        set(qkv_python_why "the first python3 on PATH with numpy")
        break()
      endif()
      list(APPEND qkv_passed_over "${dir}/python3")
    endif()
  endforeach()
  if(qkv_passed_over)
    string(REPLACE ";" ", " qkv_passed_over "${qkv_passed_over}")
    string(APPEND qkv_python_why "; passed over, no numpy: ${qkv_passed_over}")
  endif()
  string(APPEND qkv_python_why "; choose another with -DPython3_EXECUTABLE=...")
endif()
find_package(Python3 3.8 COMPONENTS Interpreter Development.Module QUIET)
if(Python3_FOUND)
  find_package(pybind11 2.6 CONFIG QUIET)  # after Python3: pybind11 then uses FindPython3's result
endif()
if(Python3_FOUND AND pybind11_FOUND)
  set(QKV_PYTHON_FOUND ON)
  message(STATUS "qkv: Python module for ${Python3_EXECUTABLE} (Python ${Python3_VERSION}, ${qkv_python_why})")
else()
  message(STATUS "qkv: Python module off (Python 3 found: ${Python3_FOUND}, pybind11 found: "
                 "${pybind11_FOUND}); Debian: apt-get install pybind11-dev python3-dev")
endif()
