# ctest package.install_without_build (run with cmake -P): what a header-only user does with the
# source tree. Configures a fresh build tree of emakit (tests off), installs it WITHOUT building,
# then configures, builds and runs the header-only find_package consumer against that prefix, and
# checks that asking for the compiled component fails with the message that says what to do.
#   -DSOURCE_DIR=<emakit source> -DCONSUMER_DIR=<tests/package/find_package_consumer>
#   -DWORK_DIR=<scratch folder, emptied first> -DINIT=<initial-cache file of this build's settings>
#   -DGENERATOR=<generator> [-DMAKE_PROGRAM=<make program>] [-DCONFIG=<config>]
#   [-DPREFIX_PATH=<CMAKE_PREFIX_PATH for LibTorch and fmt, '|'-separated>]
foreach(_var SOURCE_DIR CONSUMER_DIR WORK_DIR INIT GENERATOR)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "emakit_install_without_build.cmake: -D${_var}=... is required")
  endif()
endforeach()

file(REMOVE_RECURSE "${WORK_DIR}")
set(_build "${WORK_DIR}/emakit-build")
set(_prefix "${WORK_DIR}/prefix")
set(_common -G "${GENERATOR}")
if(MAKE_PROGRAM)
  list(APPEND _common "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
set(_config_args "")
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()
# The consumers' initial cache: this build's settings, with the new prefix first on
# CMAKE_PREFIX_PATH (a list cannot go through execute_process as one -D argument; the first
# set(... CACHE) of an entry wins, so this one goes before the copied ones).
string(REPLACE "|" ";" _prefix_path "${PREFIX_PATH}")
file(READ "${INIT}" _init_text)
set(_consumer_init "${WORK_DIR}/consumer_init.cmake")
file(WRITE "${_consumer_init}"
  "set(CMAKE_PREFIX_PATH \"${_prefix};${_prefix_path}\" CACHE STRING \"\")\n${_init_text}")

# run(<step> <expect: ok|fail> <output variable> <command>...): run a command, echo its output,
# fail the test when its outcome is not the expected one.
function(run step expect out_var)
  message(STATUS "${step}: ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  message("${_out}")
  if(expect STREQUAL "ok" AND NOT _rc EQUAL 0)
    message(FATAL_ERROR "${step} failed (exit ${_rc}); its output is above")
  elseif(expect STREQUAL "fail" AND _rc EQUAL 0)
    message(FATAL_ERROR "${step} succeeded, but it should have failed; its output is above")
  endif()
  set(${out_var} "${_out}" PARENT_SCOPE)
endfunction()

# 1. emakit configured as a header-only user does (tests off), then installed; nothing built.
run("configure emakit" ok _out
  "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${_build}" ${_common} -C "${INIT}"
  -DEMAKIT_BUILD_TESTS=OFF -DEMAKIT_INSTALL=ON)
run("install emakit without building it" ok _out
  "${CMAKE_COMMAND}" --install "${_build}" --prefix "${_prefix}" ${_config_args})
foreach(_file include/emakit/emakit.hpp share/cmake/emakit/emakitConfig.cmake share/cmake/emakit/emakitTargets.cmake)
  if(NOT EXISTS "${_prefix}/${_file}")
    message(FATAL_ERROR "the install without a build did not produce ${_prefix}/${_file}")
  endif()
endforeach()
file(GLOB_RECURSE _libraries "${_prefix}/*.a" "${_prefix}/*.lib")
if(_libraries)
  message(FATAL_ERROR "nothing was built, yet the install holds a library: ${_libraries}")
endif()

# 2. The header-only consumer: find_package(emakit) and emakit::emakit, configured, built, run.
set(_consumer "${WORK_DIR}/consumer")
run("configure the header-only consumer" ok _out
  "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${_consumer}" ${_common}
  -DEMAKIT_CONSUMER_HEADER_ONLY=ON -C "${_consumer_init}")
run("build the header-only consumer" ok _out
  "${CMAKE_COMMAND}" --build "${_consumer}" ${_config_args})
file(GLOB_RECURSE _programs "${_consumer}/emakit_consumer" "${_consumer}/emakit_consumer.exe")
if(NOT _programs)
  message(FATAL_ERROR "no emakit_consumer program under ${_consumer} after its build")
endif()
list(GET _programs 0 _program)
run("run the header-only consumer" ok _out "${_program}")

# 3. Asking for the compiled mode from this prefix fails, saying why and what to do.
run("configure the consumer of both modes (COMPONENTS compiled)" fail _out
  "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${WORK_DIR}/consumer-compiled" ${_common}
  -C "${_consumer_init}")
string(REGEX REPLACE "[ \t\r\n]+" " " _flat "${_out}")
foreach(_expected
    "emakit was installed without its compiled library (no ${_prefix}/"
    "run cmake --build <dir> before cmake --install, or use emakit::emakit")
  string(FIND "${_flat}" "${_expected}" _at)
  if(_at EQUAL -1)
    message(FATAL_ERROR "find_package(emakit COMPONENTS compiled) failed, but its message lacks '${_expected}' (output above)")
  endif()
endforeach()
message(STATUS "install without a build: header-only consumer built and ran; the compiled component is refused with its message")
