# docs.posthoc.tool_build (tests/docs/CMakeLists.txt): runs the cmake lines of docs/posthoc.md's
# "## The command-line tool" ```sh block as the page shows them, on a machine without Catch2,
# then runs the installed tool.
#
#   cmake -DPAGE=<docs/posthoc.md> -DSOURCE=<repository root> -DWORK=<scratch folder>
#         -DTORCH_DIR=<the enclosing build's Torch_DIR> [-DPREFIX_PATH=<its CMAKE_PREFIX_PATH, '|'-separated>]
#         [-DCUDA_CUDART=<its CUDA_cudart_LIBRARY>]
#         -P build_posthoc_tool.cmake
#
# The lines are read from the page each run, so the page and the test cannot drift. Two things are
# substituted, both where the page tells the reader to put their own: the LibTorch location (the
# configure line's comment says "plus your LibTorch's -DTorch_DIR=...": the enclosing build's
# Torch_DIR, and its CMAKE_PREFIX_PATH and CUDA_cudart_LIBRARY when it has them, as for a CUDA
# PyPI wheel, whose link needs the wheel's own cudart: see the top CMakeLists.txt) and the install
# prefix (`--prefix ~/.local` becomes WORK/prefix). `-S .` is WORK/src, a tree of symbolic links to
# the repository's top-level entries without its build folders (what a fresh clone holds), so
# `build/tool` is WORK/src/build/tool, made anew each run (ccache, which the top CMakeLists uses
# when it finds it, keeps a rerun cheap).
#
# No Catch2: the test appends -DCMAKE_DISABLE_FIND_PACKAGE_Catch2=ON to the configure line. Every
# find_package(Catch2 ...) of that configure then fails as on a machine without Catch2, wherever
# Catch2 is installed (a REQUIRED one stops the configure: "A REQUIRED package cannot be
# disabled"). Hiding it by path (CMAKE_IGNORE_PATH) would have to name every folder it could be
# found in: on Debian's merged /usr, ignoring /usr/lib/cmake/Catch2 still finds
# /lib/cmake/Catch2 (checked with CMake 3.25). Run against the command of before b98ae9a (no
# -DEMAKIT_BUILD_TESTS=OFF), this test fails there, in tests/CMakeLists.txt's
# find_package(Catch2 2 REQUIRED).
#
# Then: the configure never looked for Catch2 (CMake reports CMAKE_DISABLE_FIND_PACKAGE_Catch2 as
# a variable nothing used), found none (the cache holds no Catch2_DIR that was found) and set up
# no test suite (the build tree has no tests/ folder), the install put the tool in
# WORK/prefix/bin, and `emakit_example_posthoc_tool --help` exits 0 and prints its usage.
cmake_minimum_required(VERSION 3.21)

foreach(_var PAGE SOURCE WORK TORCH_DIR)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "build_posthoc_tool.cmake: -D${_var}=... is required")
  endif()
endforeach()

# ---- the block, from the page ---------------------------------------------------------------
file(READ "${PAGE}" _page)
set(_heading "## The command-line tool")
string(FIND "${_page}" "\n${_heading}\n" _at)
if(_at EQUAL -1)
  message(FATAL_ERROR "${PAGE} has no '${_heading}' section; this test runs the build command of that "
                      "section's ```sh block (update tests/docs/build_posthoc_tool.cmake if it moved)")
endif()
string(SUBSTRING "${_page}" ${_at} -1 _section)
if(NOT _section MATCHES "\n```sh\n(.*)")
  message(FATAL_ERROR "${PAGE}: the '${_heading}' section has no ```sh block")
endif()
set(_block "${CMAKE_MATCH_1}")
string(FIND "${_block}" "\n```" _end)
if(_end EQUAL -1)
  message(FATAL_ERROR "${PAGE}: the ```sh block of '${_heading}' is not closed")
endif()
string(SUBSTRING "${_block}" 0 ${_end} _block)
string(REPLACE "\n" ";" _lines "${_block}")

set(_commands "")  # the cmake lines, without their comments, in the page's order
set(_configure_comment "")
foreach(_line IN LISTS _lines)
  string(STRIP "${_line}" _line)
  if(NOT _line MATCHES "^cmake ")
    continue()
  endif()
  set(_comment "")
  if(_line MATCHES "^([^#]*)#(.*)$")
    set(_line "${CMAKE_MATCH_1}")
    set(_comment "${CMAKE_MATCH_2}")
  endif()
  string(STRIP "${_line}" _line)
  if(_line MATCHES "^cmake -S ")
    set(_configure_comment "${_comment}")
  endif()
  list(APPEND _commands "${_line}")
endforeach()
list(LENGTH _commands _count)
message(STATUS "${PAGE}, '${_heading}': ${_count} cmake lines")
set(_seen_configure OFF)
set(_seen_build OFF)
set(_seen_install OFF)
foreach(_line IN LISTS _commands)
  if(_line MATCHES "^cmake -S ")
    set(_seen_configure ON)
  elseif(_line MATCHES "^cmake --build ")
    set(_seen_build ON)
  elseif(_line MATCHES "^cmake --install ")
    set(_seen_install ON)
  endif()
endforeach()
if(NOT _seen_configure OR NOT _seen_build OR NOT _seen_install)
  message(FATAL_ERROR "${PAGE}, '${_heading}': expected a configure (cmake -S), a build (cmake --build) and "
                      "an install (cmake --install) line; found: ${_commands}")
endif()
if(NOT _configure_comment MATCHES "-DTorch_DIR=")
  message(FATAL_ERROR "${PAGE}: the configure line's comment no longer tells the reader to add -DTorch_DIR=...; "
                      "this test adds the LibTorch location only where the page says to (comment: '${_configure_comment}')")
endif()

# ---- a tree like a fresh clone, a fresh build folder ------------------------------------------
set(_src "${WORK}/src")
set(_prefix "${WORK}/prefix")
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${_src}")
file(GLOB _entries RELATIVE "${SOURCE}" "${SOURCE}/*" "${SOURCE}/.*")
foreach(_entry IN LISTS _entries)
  # The build folders (.gitignore: /build/, /build-*/, /cmake-build-*/, /out/) and Git's own.
  if(_entry MATCHES "^(\\.|\\.\\.|\\.git|build|build-.*|cmake-build-.*|out|Testing)$")
    continue()
  endif()
  file(CREATE_LINK "${SOURCE}/${_entry}" "${_src}/${_entry}" SYMBOLIC)
endforeach()

# ---- the lines, run as the page shows them ----------------------------------------------------
foreach(_line IN LISTS _commands)
  separate_arguments(_args UNIX_COMMAND "${_line}")
  list(POP_FRONT _args)  # "cmake"
  set(_shown "${_line}")
  if(_line MATCHES "^cmake -S ")
    list(APPEND _args "-DTorch_DIR=${TORCH_DIR}")
    if(PREFIX_PATH)
      string(REPLACE "|" ";" _prefix_path "${PREFIX_PATH}")
      list(APPEND _args "-DCMAKE_PREFIX_PATH=${_prefix_path}")
    endif()
    if(CUDA_CUDART)
      list(APPEND _args "-DCUDA_cudart_LIBRARY=${CUDA_CUDART}")
    endif()
    list(APPEND _args -DCMAKE_DISABLE_FIND_PACKAGE_Catch2=ON)
  elseif(_line MATCHES "^cmake --install ")
    list(FIND _args "~/.local" _home)
    if(_home EQUAL -1)
      message(FATAL_ERROR "${PAGE}: the install line no longer installs into ~/.local ('${_line}'); this test "
                          "puts a scratch prefix there (update tests/docs/build_posthoc_tool.cmake)")
    endif()
    list(REMOVE_AT _args ${_home})
    list(INSERT _args ${_home} "${_prefix}")
  endif()
  string(REPLACE ";" " " _ran "${_args}")
  message(STATUS "page: ${_shown}\n   ran: cmake ${_ran}")
  execute_process(COMMAND "${CMAKE_COMMAND}" ${_args}
    WORKING_DIRECTORY "${_src}"
    RESULT_VARIABLE _rc
    OUTPUT_VARIABLE _out ERROR_VARIABLE _err ECHO_OUTPUT_VARIABLE ECHO_ERROR_VARIABLE)
  if(_line MATCHES "^cmake -S ")
    set(_configure_log "${_out}${_err}")
  endif()
  if(NOT _rc STREQUAL "0")
    message(FATAL_ERROR "${PAGE}'s command failed (exit ${_rc}), without Catch2 on this machine's search path "
                        "(-DCMAKE_DISABLE_FIND_PACKAGE_Catch2=ON): ${_line}")
  endif()
endforeach()

# ---- what it did -------------------------------------------------------------------------------
set(_build "${_src}/build/tool")
if(NOT EXISTS "${_build}/CMakeCache.txt")
  message(FATAL_ERROR "${PAGE}'s configure line did not configure build/tool (no ${_build}/CMakeCache.txt)")
endif()
file(STRINGS "${_build}/CMakeCache.txt" _catch2 REGEX "^Catch2_DIR:")
if(_catch2 AND NOT _catch2 MATCHES "NOTFOUND")
  message(FATAL_ERROR "the configure found a Catch2 although it was disabled: ${_catch2}")
endif()
# CMake names a -D variable that nothing read: CMAKE_DISABLE_FIND_PACKAGE_Catch2 is read by every
# find_package(Catch2), so its name there means the configure never looked for Catch2.
if(NOT _configure_log MATCHES "not used by the project:[^-]*CMAKE_DISABLE_FIND_PACKAGE_Catch2")
  message(FATAL_ERROR "the configure looked for Catch2 (CMake did not report "
                      "CMAKE_DISABLE_FIND_PACKAGE_Catch2 as unused): the page's command should not need it")
endif()
if(EXISTS "${_build}/tests")
  message(FATAL_ERROR "the configure set up emakit's test suite (${_build}/tests): the page's command builds "
                      "the tool only, without Catch2")
endif()
set(_tool "${_prefix}/bin/emakit_example_posthoc_tool")
if(NOT EXISTS "${_tool}")
  message(FATAL_ERROR "the install line did not install ${_tool} (the page says ~/.local/bin/emakit_example_posthoc_tool)")
endif()
execute_process(COMMAND "${_tool}" --help RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(NOT _rc STREQUAL "0")
  message(FATAL_ERROR "${_tool} --help exited ${_rc}: ${_out}${_err}")
endif()
foreach(_word synthesize list)
  if(NOT _out MATCHES "${_word}")
    message(FATAL_ERROR "${_tool} --help does not mention its '${_word}' command: ${_out}")
  endif()
endforeach()
message(STATUS "the installed ${_tool} runs (--help: exit 0); the configure needed no Catch2")
