# ctest package.* (run with cmake -P after a consumer's build): the default mode compiles emakit's
# implementation once per program, optimized although the consumer has no build type, and a part
# (emakit::posthoc) only in a program that links it.
#
#   -DBUILD_DIR=<the consumer's build tree> -DNM=<nm> [-DTARGET=emakit_consumer] [-DPARTS=posthoc]
#
# Checks, on the consumer's objects (two translation units that include emakit and update an EMA,
# with PARTS=posthoc a third that uses the post-hoc EMA, plus the implementation files that
# emakit::emakit and emakit::posthoc add):
# 1. exactly one object defines the update kernel's entry (detail::UpdateKernel::run): the
#    core's implementation file's (emakit.cpp), not one per file that includes emakit;
# 2. with PARTS=posthoc exactly one object defines PostHocEma::update, the part's file's
#    (posthoc.cpp); without it, no object does and no posthoc.cpp was compiled (a trainer that
#    does not include the part compiles none of it);
# 3. compile_commands.json compiles the implementation files optimized (GCC: -O1 with
#    EMAKIT_OPTIMIZE_KERNELS, the update's segment functions at -O2; clang: -O2) and the
#    consumer's own files with neither (no build type: no -O flag at all).
foreach(_var BUILD_DIR NM)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "emakit_check_consumer.cmake: -D${_var}=... is required")
  endif()
endforeach()
if(NOT TARGET)
  set(TARGET emakit_consumer)
endif()
if(NOT DEFINED PARTS)
  set(PARTS "")
endif()
if(NOT PARTS STREQUAL "" AND NOT PARTS STREQUAL "posthoc")
  message(FATAL_ERROR "emakit_check_consumer.cmake: PARTS='${PARTS}', expected nothing or posthoc")
endif()
# The implementation files emakit's targets add (src/<name>.cpp, share/emakit/<name>.cpp).
set(_implementation_file "(^|/)(src|share/emakit)/(emakit|posthoc|interop)\\.cpp")

file(GLOB_RECURSE _objects "${BUILD_DIR}/CMakeFiles/${TARGET}.dir/*.o")
list(LENGTH _objects _count)
set(_expected_count 3)
set(_expected_files "main.cpp, second.cpp, emakit.cpp")
if(PARTS STREQUAL "posthoc")
  set(_expected_count 5)
  string(APPEND _expected_files ", snapshots.cpp, posthoc.cpp")
endif()
if(NOT _count EQUAL _expected_count)
  message(FATAL_ERROR "${TARGET}: expected ${_expected_count} objects (${_expected_files}), found ${_count}: ${_objects}")
endif()
set(_defining "")
set(_defining_posthoc "")
foreach(_object IN LISTS _objects)
  execute_process(COMMAND "${NM}" -C --defined-only "${_object}"
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _symbols ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${_object}: ${_err}")
  endif()
  if(_symbols MATCHES "[ \n][TtWw] emakit::[a-z_]+::detail::UpdateKernel::run\\(")
    list(APPEND _defining "${_object}")
  endif()
  if(_symbols MATCHES "[ \n][TtWw] emakit::[a-z_]+::PostHocEma::update\\(")
    list(APPEND _defining_posthoc "${_object}")
  endif()
endforeach()
list(LENGTH _defining _defined)
if(NOT _defined EQUAL 1)
  message(FATAL_ERROR "${TARGET}: ${_defined} of its ${_count} objects define "
                      "emakit::detail::UpdateKernel::run, expected exactly 1 (the implementation "
                      "file's): ${_defining}")
endif()
if(NOT _defining MATCHES "/emakit\\.cpp\\.o$")
  message(FATAL_ERROR "${TARGET}: the update kernel is defined in ${_defining}, not in the "
                      "implementation file's object")
endif()
list(LENGTH _defining_posthoc _defined_posthoc)
if(PARTS STREQUAL "posthoc")
  if(NOT _defined_posthoc EQUAL 1 OR NOT _defining_posthoc MATCHES "/posthoc\\.cpp\\.o$")
    message(FATAL_ERROR "${TARGET}: ${_defined_posthoc} of its ${_count} objects define "
                        "emakit::PostHocEma::update (${_defining_posthoc}), expected exactly 1, the "
                        "post-hoc part's file (posthoc.cpp)")
  endif()
elseif(NOT _defined_posthoc EQUAL 0)
  message(FATAL_ERROR "${TARGET} does not link emakit::posthoc, yet ${_defining_posthoc} define "
                      "emakit::PostHocEma::update: the post-hoc part was compiled into a program that "
                      "does not include it")
endif()

file(READ "${BUILD_DIR}/compile_commands.json" _json)
string(JSON _entries LENGTH "${_json}")
math(EXPR _last "${_entries} - 1")
set(_seen 0)
foreach(_i RANGE ${_last})
  string(JSON _file GET "${_json}" ${_i} file)
  string(JSON _command GET "${_json}" ${_i} command)
  if(NOT _command MATCHES "${TARGET}\\.dir")
    continue()
  endif()
  math(EXPR _seen "${_seen} + 1")
  if(_file MATCHES "${_implementation_file}$")
    set(_want_optimized ON)
  else()
    set(_want_optimized OFF)
  endif()
  if(_command MATCHES " -O1( |$)" AND _command MATCHES " -DEMAKIT_OPTIMIZE_KERNELS=1( |$)")
    set(_has_optimized ON)
  elseif(_command MATCHES " -O2( |$)" AND NOT _command MATCHES "EMAKIT_OPTIMIZE_KERNELS")
    set(_has_optimized ON)
  elseif(_command MATCHES " -O[0-9s]( |$)|EMAKIT_OPTIMIZE_KERNELS")
    message(FATAL_ERROR "${TARGET}: ${_file} has an -O flag or EMAKIT_OPTIMIZE_KERNELS, but neither "
                        "-O1 with -DEMAKIT_OPTIMIZE_KERNELS=1 (GCC) nor -O2 alone (clang):\n${_command}")
  else()
    set(_has_optimized OFF)
  endif()
  if(NOT _want_optimized STREQUAL _has_optimized)
    message(FATAL_ERROR "${TARGET}: ${_file} is compiled optimized (-O1 and EMAKIT_OPTIMIZE_KERNELS, or -O2): "
                        "${_has_optimized}, expected ${_want_optimized} (the implementation optimized, the "
                        "consumer's files as its build type says):\n${_command}")
  endif()
endforeach()
if(NOT _seen EQUAL _count)
  message(FATAL_ERROR "${TARGET}: compile_commands.json has ${_seen} commands for its ${_count} objects")
endif()
message(STATUS "${TARGET}: ${_count} objects, the update kernel defined once (${_defining}), "
               "PostHocEma::update ${_defined_posthoc} times; the implementation files compiled "
               "optimized, the rest without")
