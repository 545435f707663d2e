// The Ema's state (formats::ema_state): the keys of Ema::state_dict(), the checks of a state
// against an Ema's config, and the archive of torch::save(ema) / emakit::save. Ema says what it
// holds; this header says how that is written and read.
//
// State dict keys:
//   emakit.format                       int64, formats::ema_state.version
//   config.decay / config.schedule      the policy's name, as uint8 UTF-8 bytes
//   config.decay.<field>, config.schedule.<field>   float64 option values
//   config.options.buffers              int64, EmaOptions::buffers (0 average, 1 copy, 2 ignore);
//                                       absent in older states: then not checked
//   config.options.arithmetic           EmaOptions::arithmetic by name (arithmetic_name), as uint8
//                                       UTF-8 bytes; absent in older states: then not checked
//   counters.calls, counters.step, counters.num_updates, counters.last_update_step   int64
//   counters.last_decay                 float64
//   counters.non_finite_updates         int64 (absent in older states: 0)
//   average.<name>                      the EMA's tensors (shared, not copied)
// Archive records: emakit_state (the state dict), emakit_checksums (a CRC-32 per tensor),
// emakit_version (the writer's version, for messages).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/checksum.hpp>
#include <emakit/detail/serial/formats.hpp>
#include <emakit/detail/serial/state_reader.hpp>
#include <emakit/detail/serial/tensor_dict.hpp>
#include <emakit/options.hpp>
#include <emakit/state.hpp>
#include <emakit/version.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fmt/core.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

namespace detail {

// "custom:" and a demangled C++ type name, with emakit's mode namespace (detail/config.hpp) left
// out: `Wrap<emakit::header_only::Fixed>` is "custom:Wrap<emakit::Fixed>" in both modes, so that a
// checkpoint of either mode loads in the other.
EMAKIT_FUNC std::string custom_policy_name(std::string demangled);

// A policy's name as checkpoints record it. A policy without `name` is named by its C++ type
// ("custom:MyDecay"), so that two different custom policies do not load each other's states.
template <class P>
std::string_view policy_name() {
  if constexpr (requires { P::name; }) {
    return P::name;
  } else {
    static const std::string name = custom_policy_name(c10::demangle_type<P>());
    return name;
  }
}

template <class P>
std::vector<Field> policy_fields(const P& p) {
  if constexpr (requires {
                  { p.fields() } -> std::same_as<std::vector<Field>>;
                })
    return p.fields();
  else
    return {};
}

EMAKIT_FUNC std::string value_string(double v, bool is_integer);

namespace ema_state {

// The key of an average in a state: "average." + the tensor's name; is_average_key() and
// average_name() read one back. Every layout that holds averages (the sharded checkpoint, the
// hook's, interop's) names them through these.
inline constexpr std::string_view average_prefix = "average.";
EMAKIT_FUNC std::string average_key(const std::string& name);
inline bool is_average_key(std::string_view key) noexcept {
  return key.substr(0, average_prefix.size()) == average_prefix;
}
// The tensor's name of an average_key(); the key itself when it is not one.
inline std::string average_name(std::string_view key) {
  return std::string(is_average_key(key) ? key.substr(average_prefix.size()) : key);
}

struct Counters {
  std::int64_t calls = 0, step = 0, num_updates = 0, last_update_step = 0;
  double last_decay = std::nan("");
  std::int64_t non_finite_updates = 0;
};

// The counters' keys in a state: the one table that write_counters, read_counters and known_key
// use (an import from a Python peer writes its counters through write_counters too).
struct CounterKey {
  std::string_view key;
  std::int64_t Counters::*member;
};
// Every counter's key starts with counters_prefix (is_counter_key()): what an import leaves out of
// the state it builds from a peer's file, whose counters it writes through write_counters.
inline constexpr std::string_view counters_prefix = "counters.";
inline bool is_counter_key(std::string_view key) noexcept { return key.starts_with(counters_prefix); }
// Present in every Ema's state (what tells one apart from another layout's).
inline constexpr std::string_view calls_key = "counters.calls";
inline constexpr CounterKey integer_counters[] = {{calls_key, &Counters::calls},
                                                  {"counters.step", &Counters::step},
                                                  {"counters.num_updates", &Counters::num_updates},
                                                  {"counters.last_update_step", &Counters::last_update_step},
                                                  {"counters.non_finite_updates", &Counters::non_finite_updates}};
inline constexpr std::string_view last_decay_key = "counters.last_decay";
// Absent in states written before the non-finite guard existed: read as 0.
inline constexpr std::string_view optional_counter_key = "counters.non_finite_updates";

// What a state records of an Ema's two config policies: their names (policy_name) and fields
// (policy_fields). Ema makes one from its policies; everything below is then policy-independent.
struct PolicyConfig {
  std::string_view decay;
  std::vector<Field> decay_fields;
  std::string_view schedule;
  std::vector<Field> schedule_fields;
};

// One name an Ema holds and the slot of its tensor (a tied tensor: several names, one slot).
struct Entry {
  std::string name;
  std::size_t slot;
};

// The state dict up to the averages (format, config, counters); the caller appends
// average_key(name) -> tensor for each name it holds.
EMAKIT_FUNC StateDict encode(const PolicyConfig& config, const EmaOptions& options, const Counters& c);

EMAKIT_FUNC bool known_key(const std::string& key);

EMAKIT_FUNC void check_format(const StateDict& state);

// The state's format and config (policies, fields, buffer mode) against these policies and
// options. Throws naming the first difference.
EMAKIT_FUNC void check_config(const StateDict& state, const PolicyConfig& config, const EmaOptions& options);

EMAKIT_FUNC void write_counters(StateDict& out, const Counters& c);
EMAKIT_FUNC Counters read_counters(const StateDict& state);

EMAKIT_FUNC std::string describe(const LoadReport& r);

// What a load would do: the report, which slot gets which tensor, the counters.
struct Plan {
  LoadReport report;
  std::vector<std::pair<std::size_t, const at::Tensor*>> loads;  // slot index, tensor to copy in
  Counters counters;
};

// Checks a state against an Ema and plans its load. `entries`: every name the Ema holds;
// `averages[slot]`: the Ema's tensor; `same_value(a, b)`: whether two state tensors loaded into
// one slot agree.
EMAKIT_FUNC Plan plan_load(const StateDict& state, LoadMode mode, const PolicyConfig& config, const EmaOptions& options,
                           const std::vector<Entry>& entries, const std::vector<at::Tensor>& averages,
                           bool (*same_value)(const at::Tensor&, const at::Tensor&));

// The archive of torch::save(ema): the state dict and a CRC-32 per tensor.
EMAKIT_FUNC void save_archive(torch::serialize::OutputArchive& archive, const StateDict& state);

// Reads the state of save_archive() (every checksum checked first) and hands it to `load`, whose
// result it returns; an invalid_argument from `load` names the emakit version that wrote the file.
template <class Load>
auto load_archive(torch::serialize::InputArchive& archive, const Load& load) {
  const std::string where = "torch::load(ema)";
  auto items = read_tensor_dict(archive, "emakit_state", where);
  if (!items)
    fail("the archive holds no emakit state (no 'emakit_state' dictionary); was it written by "
         "torch::save(ema, ...)?");
  Checksums sums;
  sums.load(archive, "emakit_checksums", where);
  sums.check_all(*items, "", where);
  StateDict state;
  for (const auto& [key, t] : *items) state.insert(key, t);
  if (state.size() != sums.read.size())
    fail("{}: the archive holds {} checksums for {} tensors; the checkpoint is damaged", where, sums.read.size(),
         state.size());
  try {
    return load(state);
  } catch (const std::invalid_argument&) {
    c10::IValue writer;
    if (!archive.try_read("emakit_version", writer) || !writer.isString()) throw;
    rethrow_with_context(fmt::format(" (the file was written by emakit {})", writer.toStringRef()));
  }
}

}  // namespace ema_state
}  // namespace detail
}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/ema_state-inl.hpp>
#endif
