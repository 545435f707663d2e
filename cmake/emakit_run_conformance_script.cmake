# Runs one conformance generator: cmake -DPYTHON=... -DSCRIPT=... -DOUT=... -P this file.
# Without a Python (no venv: PyPI unreachable) it prints a SKIPPED: line, which ctest counts
# as a skipped test; a generator that cannot import its package writes OUT.skipped itself.
if(NOT PYTHON OR NOT EXISTS "${PYTHON}")
  message("SKIPPED: no Python with the reference packages (EMAKIT_PYTHON is unset); "
          "${SCRIPT} did not run")
  return()
endif()
file(REMOVE_RECURSE "${OUT}")
file(REMOVE "${OUT}.skipped")
execute_process(COMMAND "${PYTHON}" "${SCRIPT}" "${OUT}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${SCRIPT} failed with exit status ${rc}")
endif()
if(EXISTS "${OUT}.skipped")
  file(READ "${OUT}.skipped" reason)
  message("SKIPPED: ${reason}")
endif()
