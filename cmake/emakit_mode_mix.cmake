# ctest driver for the mode-mixing tests (tests/CMakeLists.txt, tests/mode_mix/), run with cmake -P.
#
#   -DBUILD_DIR=<build tree> -DOBJECTS=<object target>,<object target> -DTARGET=<executable target>
#   -DEXPECT=link_error|missing_implementation|missing_part|run [-DEXECUTABLE=<path>] [-DCONFIG=<config>]
#   [-DMODES=<namespace>,<namespace>]
#
# Builds the object targets first: they must compile, so that a compile error never passes for
# the expected link error. Then builds TARGET: with EXPECT=link_error it must fail, and the
# linker's output must name both inline namespaces of MODES (default: emakit::compiled and
# emakit::header_only) in an undefined reference; with EXPECT=missing_implementation it must fail, and an undefined reference must name
# the symbol that says what to do (detail/config.hpp's link_check); with EXPECT=missing_part it
# must fail on the post-hoc part's link check, and not on the core's (the core's file is linked);
# with EXPECT=run it must link,
# and EXECUTABLE must run and exit 0.
foreach(_var BUILD_DIR OBJECTS TARGET EXPECT)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "emakit_mode_mix.cmake: -D${_var}=... is required")
  endif()
endforeach()
set(_config_args "")
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()

function(_emakit_build target result output)
  execute_process(
    COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${target}" ${_config_args}
    RESULT_VARIABLE _result
    OUTPUT_VARIABLE _output
    ERROR_VARIABLE _output)
  set(${result} "${_result}" PARENT_SCOPE)
  set(${output} "${_output}" PARENT_SCOPE)
endfunction()

string(REPLACE "," ";" _objects "${OBJECTS}")
foreach(_object IN LISTS _objects)
  _emakit_build("${_object}" _result _output)
  if(NOT _result EQUAL 0)
    message(FATAL_ERROR "${_object} did not compile: a compile error is not the link error this test "
                        "expects. Fix the source first.\n${_output}")
  endif()
endforeach()

_emakit_build("${TARGET}" _result _output)
if(EXPECT STREQUAL "link_error")
  if(_result EQUAL 0)
    message(FATAL_ERROR "${TARGET} linked, but it mixes translation units of two modes (${MODES}) "
                        "and must not: the mode-tagged namespace (detail/config.hpp) is not "
                        "doing its job.\n${_output}")
  endif()
  if(NOT MODES)
    set(MODES "compiled,header_only")
  endif()
  string(REPLACE "," ";" _modes "${MODES}")
  set(_missing "")
  foreach(_mode IN LISTS _modes)
    if(NOT _output MATCHES "(undefined reference to|undefined symbol)[^\n]*emakit::${_mode}::")
      list(APPEND _missing "emakit::${_mode}")
    endif()
  endforeach()
  if(_missing)
    message(FATAL_ERROR "${TARGET} failed to build, but no undefined reference names ${_missing}: "
                        "not the expected mode-mixing link error.\n${_output}")
  endif()
  list(TRANSFORM _modes PREPEND "emakit::")
  list(JOIN _modes " and " _named)
  message(STATUS "${TARGET}: the link fails and names ${_named}")
elseif(EXPECT STREQUAL "missing_implementation")
  if(_result EQUAL 0)
    message(FATAL_ERROR "${TARGET} linked without emakit's implementation file and must not: "
                        "detail/config.hpp's link_check reference is not doing its job.\n${_output}")
  endif()
  set(_symbol "link_check::define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_emakit")
  if(NOT _output MATCHES "(undefined reference to|undefined symbol)[^\n]*${_symbol}")
    message(FATAL_ERROR "${TARGET} failed to build, but no undefined reference names ${_symbol}: "
                        "not the message that tells a user what to do.\n${_output}")
  endif()
  message(STATUS "${TARGET}: the link fails and names ${_symbol}")
elseif(EXPECT STREQUAL "missing_part")
  set(_symbol "link_check::define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_posthoc")
  set(_core "link_check::define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_emakit")
  if(_result EQUAL 0)
    message(FATAL_ERROR "${TARGET} includes <emakit/posthoc.hpp> and linked without the post-hoc part's "
                        "file (src/posthoc.cpp) and must not: the part's link check "
                        "(emakit/posthoc/part.hpp) is not doing its job.\n${_output}")
  endif()
  if(NOT _output MATCHES "(undefined reference to|undefined symbol)[^\n]*${_symbol}")
    message(FATAL_ERROR "${TARGET} failed to build, but no undefined reference names ${_symbol}: "
                        "not the message that tells a user to link emakit::posthoc.\n${_output}")
  endif()
  if(_output MATCHES "${_core}")
    message(FATAL_ERROR "${TARGET} links the core's implementation file, but the link names ${_core}: "
                        "the core's own check failed, not only the part's.\n${_output}")
  endif()
  message(STATUS "${TARGET}: the link fails and names ${_symbol} (and not the core's check)")
elseif(EXPECT STREQUAL "run")
  if(NOT _result EQUAL 0)
    message(FATAL_ERROR "${TARGET} (both translation units in one mode) did not build: the "
                        "mode-mixing test's control must link.\n${_output}")
  endif()
  execute_process(COMMAND "${EXECUTABLE}" RESULT_VARIABLE _result OUTPUT_VARIABLE _output ERROR_VARIABLE _output)
  if(NOT _result EQUAL 0)
    message(FATAL_ERROR "${EXECUTABLE} exited with ${_result}, expected 0.\n${_output}")
  endif()
  message(STATUS "${TARGET}: links and runs: ${_output}")
else()
  message(FATAL_ERROR "emakit_mode_mix.cmake: EXPECT='${EXPECT}', expected link_error, missing_implementation, missing_part or run")
endif()
