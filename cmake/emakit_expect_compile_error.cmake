# ctest driver for tests/compile_fail/*.cpp (run with cmake -P).
#
#   -DBUILD_DIR=<build tree> -DTARGET=<EXCLUDE_FROM_ALL object target> -DSOURCE=<file.cpp>
#   [-DCONFIG=<config>]
#
# Passes only when building TARGET fails AND the build output matches every regex given
# in the source by a line `// expect-error: <regex>`. A file with no such line fails, so a
# compile-fail test cannot pass for the wrong reason (a typo, a missing include).
foreach(_var BUILD_DIR TARGET SOURCE)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "emakit_expect_compile_error.cmake: -D${_var}=... is required")
  endif()
endforeach()

file(STRINGS "${SOURCE}" _lines REGEX "^[ \t]*//[ \t]*expect-error:")
set(_patterns "")
foreach(_line IN LISTS _lines)
  string(REGEX REPLACE "^[ \t]*//[ \t]*expect-error:[ \t]*" "" _pattern "${_line}")
  string(STRIP "${_pattern}" _pattern)
  if(NOT _pattern STREQUAL "")
    list(APPEND _patterns "${_pattern}")
  endif()
endforeach()
if(NOT _patterns)
  message(FATAL_ERROR "${SOURCE}: no `// expect-error: <regex>` line; say which error is expected")
endif()

set(_config_args "")
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" ${_config_args}
  RESULT_VARIABLE _result
  OUTPUT_VARIABLE _output
  ERROR_VARIABLE _output)

if(_result EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but it must not compile.\n${_output}")
endif()
set(_missing "")
foreach(_pattern IN LISTS _patterns)
  if(NOT _output MATCHES "${_pattern}")
    list(APPEND _missing "${_pattern}")
  endif()
endforeach()
if(_missing)
  string(LENGTH "${_output}" _len)
  if(_len GREATER 20000)
    string(SUBSTRING "${_output}" 0 20000 _output)
    string(APPEND _output "\n[... output truncated ...]")
  endif()
  message(FATAL_ERROR
    "${SOURCE} failed to compile as expected, but the output does not match: ${_missing}\n"
    "---- compiler output ----\n${_output}")
endif()
message(STATUS "${SOURCE}: failed to compile with the expected error (${_patterns})")
