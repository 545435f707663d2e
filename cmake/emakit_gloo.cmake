# The Gloo headers (gloo/algorithm.h), found once for every part of the build that makes a Gloo
# process group: tests/distributed, examples/sharded.cpp and the sharded documentation sample.
# c10d's ProcessGroupGloo.hpp includes them; Debian's libgloo-dev has them, the PyPI wheel ships
# none (include/emakit/gloo.hpp). Sets the cache variable EMAKIT_GLOO_INCLUDE_DIR (empty/NOTFOUND
# without them: each user then leaves its Gloo part out or skips it) and defines
#   emakit_use_gloo_headers(<target>)   adds them to <target>'s include path, after LibTorch's own
#                                       folders (a wheel's bundled headers win where both have one)
include_guard(GLOBAL)

find_path(EMAKIT_GLOO_INCLUDE_DIR gloo/algorithm.h DOC "Folder holding the Gloo headers (gloo/algorithm.h)")

function(emakit_use_gloo_headers target)
  if(NOT EMAKIT_GLOO_INCLUDE_DIR)
    message(FATAL_ERROR "emakit_use_gloo_headers(${target}): no Gloo headers were found "
      "(EMAKIT_GLOO_INCLUDE_DIR is '${EMAKIT_GLOO_INCLUDE_DIR}'); check EMAKIT_GLOO_INCLUDE_DIR "
      "before calling it, or install libgloo-dev")
  endif()
  target_include_directories(${target} SYSTEM AFTER PRIVATE "${EMAKIT_GLOO_INCLUDE_DIR}")
endfunction()
