// emakit's core, compiled once per program (detail/config.hpp): everything <emakit/emakit.hpp>
// declares (the Ema and its policies, the update kernel, checkpoints, hooks, the teacher,
// update_bn, the formats). emakit::emakit adds src/emakit.cpp, which includes this, to the
// target that links it; the plain-include file (EMAKIT_IMPLEMENTATION before <emakit/emakit.hpp>)
// and libemakit.a compile it with the other parts (implementation.hpp).
//
// Every <name>-inl.hpp is included by exactly one part (this file, posthoc.hpp, interop.hpp
// beside it), once, and compiled with external linkage. CMakeLists.txt checks at configure time
// that the parts' lists name every include/emakit/**/*-inl.hpp once: a new -inl.hpp not listed
// stops the configure step.
#pragma once

#include <emakit/detail/implementation_part.hpp>

#include <emakit/emakit.hpp>

#include <emakit/checkpoint-inl.hpp>
#include <emakit/detail/cpu_pass-inl.hpp>
#include <emakit/detail/errors-inl.hpp>
#include <emakit/detail/module_tensors-inl.hpp>
#include <emakit/detail/serial/archive_file-inl.hpp>
#include <emakit/detail/serial/archive_scan-inl.hpp>
#include <emakit/detail/serial/atomic_file-inl.hpp>
#include <emakit/detail/serial/checksum-inl.hpp>
#include <emakit/detail/serial/ema_state-inl.hpp>
#include <emakit/detail/serial/formats-inl.hpp>
#include <emakit/detail/serial/hook_state-inl.hpp>
#include <emakit/detail/serial/torch_pickle-inl.hpp>
#include <emakit/detail/update_kernel-inl.hpp>
#include <emakit/detail/update_plan-inl.hpp>
#include <emakit/ema-inl.hpp>
#include <emakit/format-inl.hpp>
#include <emakit/hooks-inl.hpp>
#include <emakit/presets-inl.hpp>
#include <emakit/storage-inl.hpp>
#include <emakit/teacher-inl.hpp>
#include <emakit/update_bn-inl.hpp>

// Not compiled in any part, inline in every mode: sharded.hpp and sharded/*, gloo.hpp, jit.hpp
// (they need c10d, Gloo and TorchScript, which the implementation would impose on every user).

// The one definition of what every translation unit of the program refers to (detail/config.hpp).
EMAKIT_DEFINE_LINK_CHECK(define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_emakit)
