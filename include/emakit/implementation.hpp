// emakit's non-template code, compiled once per program (detail/config.hpp): the one translation
// unit that defines EMAKIT_IMPLEMENTATION before including <emakit/emakit.hpp> gets it here. With
// CMake, emakit::emakit adds such a file to the target that links it (share/emakit/emakit.cpp
// once installed, src/emakit.cpp in the source tree), and emakit::compiled's libemakit.a is the
// same file compiled into a library.
//
// Every <name>-inl.hpp is included here, once, and compiled with external linkage.
// CMakeLists.txt checks at configure time that this list names every include/emakit/**/*-inl.hpp:
// a new -inl.hpp not listed here stops the configure step.
#pragma once

#if !defined(EMAKIT_IMPLEMENTATION)
#error \
    "emakit/implementation.hpp is emakit's compiled code: include it only through <emakit/emakit.hpp> in the one file that defines EMAKIT_IMPLEMENTATION"
#endif
#if defined(EMAKIT_HEADER_ONLY)
#error "emakit: EMAKIT_IMPLEMENTATION with EMAKIT_HEADER_ONLY: the all-inline mode has no implementation file"
#endif

#define EMAKIT_BUILDING_LIBRARY 1

#include <emakit/emakit.hpp>
#include <emakit/interop.hpp>

#include <emakit/checkpoint-inl.hpp>
#include <emakit/detail/cpu_pass-inl.hpp>
#include <emakit/detail/errors-inl.hpp>
#include <emakit/detail/module_tensors-inl.hpp>
#include <emakit/detail/serial/archive_file-inl.hpp>
#include <emakit/detail/serial/archive_scan-inl.hpp>
#include <emakit/detail/serial/atomic_file-inl.hpp>
#include <emakit/detail/serial/checksum-inl.hpp>
#include <emakit/detail/serial/formats-inl.hpp>
#include <emakit/detail/serial/ema_state-inl.hpp>
#include <emakit/detail/serial/hook_state-inl.hpp>
#include <emakit/detail/serial/snapshot_file-inl.hpp>
#include <emakit/detail/serial/torch_pickle-inl.hpp>
#include <emakit/detail/update_kernel-inl.hpp>
#include <emakit/detail/update_plan-inl.hpp>
#include <emakit/ema-inl.hpp>
#include <emakit/format-inl.hpp>
#include <emakit/hooks-inl.hpp>
#include <emakit/interop-inl.hpp>
#include <emakit/posthoc/options-inl.hpp>
#include <emakit/posthoc/profile_math-inl.hpp>
#include <emakit/posthoc/snapshot_folder-inl.hpp>
#include <emakit/posthoc/synthesis-inl.hpp>
#include <emakit/posthoc/tracker-inl.hpp>
#include <emakit/presets-inl.hpp>
#include <emakit/storage-inl.hpp>
#include <emakit/teacher-inl.hpp>
#include <emakit/update_bn-inl.hpp>

// Not compiled here, inline in every mode: sharded.hpp and sharded/*, gloo.hpp, jit.hpp (they
// need c10d, Gloo and TorchScript, which the implementation would impose on every user).

namespace emakit::inline EMAKIT_ABI_NAMESPACE::link_check {
// The one definition of what every translation unit of the program refers to (detail/config.hpp).
extern const int define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_emakit;
const int define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_emakit = 1;
}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::link_check
