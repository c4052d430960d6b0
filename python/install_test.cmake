# Installs the built qkv into a scratch prefix, then imports the installed Python package from
# a directory outside the build tree and runs one attention call.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result WORKING_DIRECTORY ${WORK_DIR})
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "python install test: step failed (${result}): ${ARGN}")
  endif()
endfunction()
step(${CMAKE_COMMAND} --install ${QKV_BUILD_DIR} --prefix ${WORK_DIR}/prefix)
file(WRITE ${WORK_DIR}/check.py "
import numpy as np
import qkv
assert qkv.__file__.startswith('${WORK_DIR}/prefix/'), qkv.__file__
x = np.ones((2, 3, 4), np.float32)
print('installed qkv', qkv.__version__, 'from', qkv.__file__, '->', qkv.scaled_dot_product_attention(x, x, x).shape)
")
step(${CMAKE_COMMAND} -E env PYTHONPATH=${WORK_DIR}/prefix/${PACKAGE_DIR} PYTHONDONTWRITEBYTECODE=1
     ${PYTHON} ${WORK_DIR}/check.py)
