// The compiled mode's one definition of emakit's non-template code (detail/config.hpp): every
// <name>-inl.hpp is included here, once, and compiled with external linkage instead of inline in
// each user's translation unit. CMakeLists.txt checks at configure time that this list names
// every include/emakit/**/*-inl.hpp: a new -inl.hpp not listed here stops the configure step.
#define EMAKIT_BUILDING_LIBRARY 1
#if !defined(EMAKIT_COMPILED)
#define EMAKIT_COMPILED 1
#endif

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

// Not compiled here, inline in both modes: sharded.hpp and sharded/*, gloo.hpp, jit.hpp (they
// need c10d, Gloo and TorchScript, which the library would impose on every user).
