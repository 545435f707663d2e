# emakit_torch_pairing_error(<out-var>): the one check that the libtorch TorchConfig found belongs
# to the LibTorch it configured. Used by CMakeLists.txt (a FATAL_ERROR) and by the installed
# emakitConfig.cmake (emakit_FOUND FALSE), so both say the same thing.
#
# TorchConfig finds libtorch with find_library, which searches the system before its own prefix:
# a PyPI wheel found through share/cmake, with Debian's libtorch-dev also installed, gets paired
# with /usr/lib/.../libtorch.so (1.13), and the build would link two LibTorch versions.
# Sets <out-var> to the message (what was found, what was expected, what to do), or to "" when
# the pairing is right or cannot be checked (no TORCH_INSTALL_PREFIX/lib/libtorch.so).
include_guard(GLOBAL)

function(emakit_torch_pairing_error out_var)
  set(_message "")
  if(DEFINED TORCH_INSTALL_PREFIX AND EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch.so"
     AND TORCH_LIBRARY)
    get_filename_component(_found "${TORCH_LIBRARY}" REALPATH)
    get_filename_component(_own "${TORCH_INSTALL_PREFIX}/lib/libtorch.so" REALPATH)
    if(NOT _found STREQUAL _own)
      string(CONCAT _message
        "TorchConfig at ${TORCH_INSTALL_PREFIX} found a foreign libtorch (${TORCH_LIBRARY}; "
        "expected ${TORCH_INSTALL_PREFIX}/lib/libtorch.so). Configure with "
        "-DCMAKE_PREFIX_PATH=${TORCH_INSTALL_PREFIX} (the torch package root, not share/cmake) "
        "in a fresh build directory.")
    endif()
  endif()
  set(${out_var} "${_message}" PARENT_SCOPE)
endfunction()
