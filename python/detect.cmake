# Finds what the Python module needs and sets QKV_PYTHON_FOUND, the default of QKV_BUILD_PYTHON.
# Included from the top-level CMakeLists.txt before the option is declared.
#
# The interpreter: on Debian, /usr/bin/python3 is the one that sees the Debian packages the
# module and its tests use (python3-numpy, python3-pytest, python3-torch); a pyenv or venv
# python3 earlier on PATH would not. Prefer it unless the user names one with
# -DPython3_EXECUTABLE=...
set(QKV_PYTHON_FOUND OFF)
if(QKV_SANITIZE)
  # An extension module under ASan needs the sanitizer runtime preloaded into python3.
  return()
endif()
if(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python3_EXECUTABLE /usr/bin/python3)
endif()
find_package(Python3 3.8 COMPONENTS Interpreter Development.Module QUIET)
if(Python3_FOUND)
  find_package(pybind11 2.6 CONFIG QUIET)  # after Python3: pybind11 then uses FindPython3's result
endif()
if(Python3_FOUND AND pybind11_FOUND)
  set(QKV_PYTHON_FOUND ON)
else()
  message(STATUS "qkv: Python module off (Python 3 found: ${Python3_FOUND}, pybind11 found: "
                 "${pybind11_FOUND}); Debian: apt-get install pybind11-dev python3-dev")
endif()
