# emakit_implementation.cmake: compile emakit's implementation files (src/emakit.cpp, and each
# part's src/<part>.cpp; installed under share/emakit/) optimized in every target that
# emakit::emakit or a part's target (emakit::posthoc, emakit::interop) adds them to, whatever the
# build type: a Debug build, or one with no build type, then updates at full speed (without it,
# -O0 makes the update 10-25x slower; docs/performance.md). Used by CMakeLists.txt and by the
# installed emakitConfig.cmake.
#
#   emakit_optimize_implementation(<absolute path of the implementation file>)
#
# Each file is an INTERFACE_SOURCES entry of its target, compiled as part of each consuming
# target (in parallel with its own files) and not as a library of its own, which the Makefile
# generators would build before the target's first file. Source file properties are scoped to a
# directory, and the consumers' directories are not known here: the properties are set at the end
# of the top-level directory's processing (cmake_language(DEFER)), in every directory of the
# project. They are:
#   COMPILE_OPTIONS           GCC: -O1 in every configuration but MinSizeRel, after the
#                             configuration's own flags, and COMPILE_DEFINITIONS
#                             EMAKIT_OPTIMIZE_KERNELS, with which the update's segment functions
#                             ask for -O2 (detail/simd.hpp): the file's cold code (checkpoints,
#                             interop, post-hoc) compiles a quarter faster at -O1 than at -O2 and
#                             the update runs as fast (docs/performance.md). Clang, which has no
#                             per-function level: -O2 in configurations that do not optimize
#                             (Debug, none, any other than Release/RelWithDebInfo/MinSizeRel)
#   SKIP_PRECOMPILE_HEADERS   a consumer's precompiled header would include emakit before the file
#                             defines EMAKIT_IMPLEMENTATION
#   SKIP_UNITY_BUILD_INCLUSION the same for a unity build's combined file
include_guard(GLOBAL)

function(_emakit_implementation_properties source)
  set(_dirs "")
  set(_pending "${CMAKE_SOURCE_DIR}")
  while(_pending)
    list(POP_FRONT _pending _dir)
    list(APPEND _dirs "${_dir}")
    get_property(_subdirs DIRECTORY "${_dir}" PROPERTY SUBDIRECTORIES)
    list(APPEND _pending ${_subdirs})
  endwhile()
  set(_gcc "$<AND:$<CXX_COMPILER_ID:GNU>,$<NOT:$<CONFIG:MinSizeRel>>>")
  set(_clang "$<AND:$<CXX_COMPILER_ID:Clang,AppleClang>,$<NOT:$<CONFIG:Release,RelWithDebInfo,MinSizeRel>>>")
  set_source_files_properties("${source}" DIRECTORY ${_dirs} PROPERTIES
    COMPILE_OPTIONS "$<${_gcc}:-O1>;$<${_clang}:-O2>"
    COMPILE_DEFINITIONS "$<${_gcc}:EMAKIT_OPTIMIZE_KERNELS=1>"
    SKIP_PRECOMPILE_HEADERS ON
    SKIP_UNITY_BUILD_INCLUSION ON)
endfunction()

function(emakit_optimize_implementation source)
  get_property(_scheduled GLOBAL PROPERTY _EMAKIT_IMPLEMENTATION_SCHEDULED)
  if(source IN_LIST _scheduled)
    return()
  endif()
  set_property(GLOBAL APPEND PROPERTY _EMAKIT_IMPLEMENTATION_SCHEDULED "${source}")
  # A deferred call's arguments are evaluated when it runs, where `source` no longer exists: the
  # path goes in as text.
  cmake_language(EVAL CODE
    "cmake_language(DEFER DIRECTORY [[${CMAKE_SOURCE_DIR}]] CALL _emakit_implementation_properties [[${source}]])")
endfunction()
