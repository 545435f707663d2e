# Runs one documentation sample for ctest (tests/docs/CMakeLists.txt):
#   cmake -DSAMPLE=<executable> -DDIR=<scratch folder> -DWHERE=<page.md:line> -P run_sample.cmake
# DIR is emptied first, so that a sample starts as a reader's would, in an empty folder (samples
# write ema.pt, last.pt, runs/ ...) and never reads what an earlier run left. The sample's main
# must return 0: a non-zero return, an uncaught exception or a crash fails the test, naming the
# Markdown file and line of the sample.
foreach(_var SAMPLE DIR WHERE)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "run_sample.cmake: -D${_var}=... is missing")
  endif()
endforeach()
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")
execute_process(COMMAND "${SAMPLE}" WORKING_DIRECTORY "${DIR}" RESULT_VARIABLE _rc)
if(NOT _rc STREQUAL "0")
  message(FATAL_ERROR "the sample at ${WHERE} failed: its main returned ${_rc} (run in ${DIR})")
endif()
message(STATUS "the sample at ${WHERE} ran and returned 0")
