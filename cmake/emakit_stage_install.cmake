# ctest fixture: install the build tree into a fresh prefix (run with cmake -P).
#   -DBUILD_DIR=<build tree> -DPREFIX=<stage prefix> [-DCONFIG=<config>]
file(REMOVE_RECURSE "${PREFIX}")
set(_config_args "")
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${_config_args}
  RESULT_VARIABLE _result)
if(NOT _result EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${_result})")
endif()
if(NOT EXISTS "${PREFIX}/include/emakit/version.hpp")
  message(FATAL_ERROR "install did not produce ${PREFIX}/include/emakit/version.hpp")
endif()
