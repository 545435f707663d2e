# ctest house.fwd_without_libtorch: <emakit/fwd.hpp> compiles, and the headers it reaches are
# emakit's and the standard library's only: no LibTorch (ATen, c10, torch, caffe2) and no fmt,
# wherever those are installed (Debian puts them on the compiler's default include path, so
# leaving them off -I would prove nothing: the compiler's own list of what it opened, -H, is read).
#   cmake -DCXX=<compiler> -DINCLUDE_DIR=<repo>/include -DSOURCE=<fwd_without_libtorch.cpp> -P <this>
foreach(_var CXX INCLUDE_DIR SOURCE)
  if(NOT ${_var})
    message(FATAL_ERROR "check_fwd_without_libtorch: -D${_var}=... is required")
  endif()
endforeach()
execute_process(COMMAND "${CXX}" -std=c++20 -fsyntax-only -H "-I${INCLUDE_DIR}" "${SOURCE}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE opened)
if(NOT rc EQUAL 0)
  execute_process(COMMAND "${CXX}" -std=c++20 -fsyntax-only "-I${INCLUDE_DIR}" "${SOURCE}" ERROR_VARIABLE errors)
  message(FATAL_ERROR "check_fwd_without_libtorch: ${SOURCE} does not compile (exit ${rc}):\n${errors}")
endif()
# -H prints one line per header opened: dots for the depth, a space, the path.
string(REGEX MATCHALL "(^|\n)\\.+ [^\n]+" lines "${opened}")
set(emakit_headers 0)
set(foreign "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE "^\n?\\.+ " "" path "${line}")
  if(path MATCHES "/emakit/[^/]+(/[^/]+)*\\.hpp$")
    math(EXPR emakit_headers "${emakit_headers} + 1")
  endif()
  if(path MATCHES "/(ATen|c10|torch|caffe2|fmt)/")
    string(APPEND foreign "\n  ${path}")
  endif()
endforeach()
list(LENGTH lines opened_count)
if(foreign)
  message(FATAL_ERROR "check_fwd_without_libtorch: <emakit/fwd.hpp> reaches LibTorch or fmt headers:${foreign}")
endif()
if(emakit_headers LESS 3)
  message(FATAL_ERROR "check_fwd_without_libtorch: the compiler listed ${emakit_headers} emakit headers of "
    "${opened_count} opened; expected fwd.hpp, concepts.hpp and config.hpp at least: did -H's format change?")
endif()
message(STATUS "check_fwd_without_libtorch: ${opened_count} headers opened, ${emakit_headers} of emakit, none of "
  "LibTorch or fmt")
