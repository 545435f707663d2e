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

namespace emakit {

enum class LoadMode : std::uint8_t {
  strict,   // any missing, unexpected or mismatched tensor is an error and nothing is loaded
  lenient,  // such tensors are reported (and warned about) and keep their current values
};

// What load_state_dict() found besides the tensors it loaded.
struct LoadReport {
  std::vector<std::string> missing;     // keys this EMA has and the state lacks
  std::vector<std::string> unexpected;  // keys the state has and this EMA lacks
  std::vector<std::string> mismatched;  // "key: why" for shape or dtype mismatches
  bool clean() const noexcept { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

namespace detail {

// A policy's name as checkpoints record it. A policy without `name` is named by its C++ type
// ("custom:MyDecay"), so that two different custom policies do not load each other's states.
template <class P>
std::string_view policy_name() {
  if constexpr (requires { P::name; }) {
    return P::name;
  } else {
    static const std::string name = std::string("custom:") + c10::demangle_type<P>();
    return name;
  }
}

template <class P>
std::vector<Field> policy_fields(const P& p) {
  if constexpr (requires { { p.fields() } -> std::same_as<std::vector<Field>>; })
    return p.fields();
  else
    return {};
}

EMAKIT_FUNC std::string value_string(double v, bool is_integer);

namespace ema_state {

inline constexpr std::string_view average_prefix = "average.";
EMAKIT_FUNC std::string average_key(const std::string& name);

struct Counters {
  std::int64_t calls = 0, step = 0, num_updates = 0, last_update_step = 0;
  double last_decay = std::nan("");
  std::int64_t non_finite_updates = 0;
};

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
EMAKIT_FUNC Plan plan_load(const StateDict& state, LoadMode mode, const PolicyConfig& config,
                           const EmaOptions& options, const std::vector<Entry>& entries,
                           const std::vector<at::Tensor>& averages,
                           bool (*same_value)(const at::Tensor&, const at::Tensor&));

// The archive of torch::save(ema): the state dict and a CRC-32 per tensor.
EMAKIT_FUNC void save_archive(torch::serialize::OutputArchive& archive, const StateDict& state);

// Reads the state of save_archive() (every checksum checked first) and hands it to `load`; an
// invalid_argument from `load` names the emakit version that wrote the file.
template <class Load>
void load_archive(torch::serialize::InputArchive& archive, const Load& load) {
  const std::string where = "torch::load(ema)";
  auto items = read_tensor_dict(archive, "emakit_state", where);
  if (!items)
    fail("the archive holds no emakit state (no 'emakit_state' dictionary); was it written by "
         "torch::save(ema, ...)?");
  Checksums sums;
  sums.load(archive, "emakit_checksums", where);
  StateDict state;
  for (const auto& [key, t] : *items) {
    sums.check(key, t, where);
    state.insert(key, t);
  }
  if (state.size() != sums.read.size())
    fail("{}: the archive holds {} checksums for {} tensors; the checkpoint is damaged", where, sums.read.size(),
         state.size());
  try {
    load(state);
  } catch (const std::invalid_argument& e) {
    c10::IValue writer;
    if (!archive.try_read("emakit_version", writer) || !writer.isString()) throw;
    throw std::invalid_argument(fmt::format("{} (the file was written by emakit {})", e.what(), writer.toStringRef()));
  }
}

}  // namespace ema_state
}  // namespace detail
}  // namespace emakit

#if EMAKIT_DEFINITIONS

#include <fmt/format.h>  // fmt::join
#include <fmt/ranges.h>

namespace emakit::detail {

EMAKIT_FUNC std::string value_string(double v, bool is_integer) {
  return is_integer ? fmt::format("{}", static_cast<std::int64_t>(v)) : fmt::format("{}", v);
}

}  // namespace emakit::detail

namespace emakit::detail::ema_state {

EMAKIT_FUNC std::string average_key(const std::string& name) { return std::string(average_prefix) + name; }

EMAKIT_FUNC bool known_key(const std::string& key) {
  if (key == "config.options.buffers") return true;  // checked by check_config()
  static const char* const fixed[] = {"emakit.format",        "counters.calls",           "counters.step",
                                      "counters.num_updates", "counters.last_update_step", "counters.last_decay",
                                      "counters.non_finite_updates"};
  for (const char* k : fixed)
    if (key == k) return true;
  // check_policy() has checked every key under these two already.
  return key == "config.decay" || key == "config.schedule" || key.rfind("config.decay.", 0) == 0 ||
         key.rfind("config.schedule.", 0) == 0;
}

EMAKIT_FUNC void check_format(const StateDict& state) {
  const at::Tensor* f = state.find("emakit.format");
  if (f == nullptr) fail("the state has no 'emakit.format' entry; it is not an emakit EMA state");
  if (f->numel() != 1 || f->item<std::int64_t>() != formats::ema_state.version)
    fail("the state's emakit.format is {}, this emakit ({}) reads format {}",
         f->numel() == 1 ? fmt::format("{}", f->item<std::int64_t>()) : std::string("not a number"), version_string,
         formats::ema_state.version);
}

EMAKIT_FUNC void write_config(StateDict& out, const std::string& axis, std::string_view name,
                              const std::vector<Field>& fields) {
  out.insert("config." + axis, string_tensor(name));
  for (const auto& f : fields)
    out.insert("config." + axis + "." + std::string(f.name), at::scalar_tensor(f.value, at::kDouble));
}

EMAKIT_FUNC StateDict encode(const PolicyConfig& config, const EmaOptions& options, const Counters& c) {
  StateDict out;
  out.insert("emakit.format", at::scalar_tensor(formats::ema_state.version, at::kLong));
  write_config(out, "decay", config.decay, config.decay_fields);
  write_config(out, "schedule", config.schedule, config.schedule_fields);
  out.insert("config.options.buffers", at::scalar_tensor(static_cast<std::int64_t>(options.buffers()), at::kLong));
  out.insert("counters.calls", at::scalar_tensor(c.calls, at::kLong));
  out.insert("counters.step", at::scalar_tensor(c.step, at::kLong));
  out.insert("counters.num_updates", at::scalar_tensor(c.num_updates, at::kLong));
  out.insert("counters.last_update_step", at::scalar_tensor(c.last_update_step, at::kLong));
  out.insert("counters.last_decay", at::scalar_tensor(c.last_decay, at::kDouble));
  out.insert("counters.non_finite_updates", at::scalar_tensor(c.non_finite_updates, at::kLong));
  return out;
}

EMAKIT_FUNC void check_policy(const StateDict& state, const std::string& axis, std::string_view ours,
                              const std::vector<Field>& fields) {
  const std::string kind_key = "config." + axis;
  const auto theirs = StateReader(state).optional_text(kind_key);
  if (!theirs) fail("the state has no '{}' (this EMA's {} policy is {})", kind_key, axis, ours);
  if (*theirs != ours) fail("config differs: {} policy is {} in the state, {} in this EMA", axis, *theirs, ours);
  for (const auto& f : fields) {
    const std::string key = kind_key + "." + std::string(f.name);
    const at::Tensor* t = state.find(key);
    if (t == nullptr) fail("config differs: the state has no '{}'", key);
    const double v = t->item<double>();
    if (v != f.value)
      fail("config differs: {} is {} in the state, {} in this EMA", key, value_string(v, f.is_integer),
           value_string(f.value, f.is_integer));
  }
  const std::string prefix = kind_key + ".";
  for (const auto& item : state) {
    if (item.key().rfind(prefix, 0) != 0) continue;
    const std::string name = item.key().substr(prefix.size());
    bool ours_has = false;
    for (const auto& f : fields) ours_has = ours_has || f.name == name;
    if (!ours_has) fail("config differs: the state has '{}', which {} does not have", item.key(), ours);
  }
}

EMAKIT_FUNC void check_config(const StateDict& state, const PolicyConfig& config, const EmaOptions& options) {
  check_format(state);
  check_policy(state, "decay", config.decay, config.decay_fields);
  check_policy(state, "schedule", config.schedule, config.schedule_fields);
  if (const auto theirs = StateReader(state).optional_integer("config.options.buffers")) {
    auto name = [](std::int64_t v) {
      return v == 0 ? std::string("average") : v == 1 ? std::string("copy") : v == 2 ? std::string("ignore")
                                                                                 : fmt::format("{} (unknown)", v);
    };
    const auto ours = static_cast<std::int64_t>(options.buffers());
    if (*theirs != ours)
      fail("config differs: config.options.buffers (EmaOptions::buffers) is {} in the state, {} in this EMA",
           name(*theirs), name(ours));
  }
}

EMAKIT_FUNC Plan plan_load(const StateDict& state, LoadMode mode, const PolicyConfig& config,
                           const EmaOptions& options, const std::vector<Entry>& entries,
                           const std::vector<at::Tensor>& averages,
                           bool (*same_value)(const at::Tensor&, const at::Tensor&)) {
  check_config(state, config, options);
  Plan plan{{}, {}, read_counters(state)};
  LoadReport& report = plan.report;
  std::vector<std::pair<const at::Tensor*, std::string>> chosen(averages.size(), {nullptr, {}});
  std::unordered_set<std::string> ours;
  std::vector<std::pair<std::string, std::size_t>> absent;  // (key, slot)
  for (const auto& e : entries) {
    const at::Tensor& average = averages[e.slot];
    std::string key = average_key(e.name);
    const at::Tensor* t = state.find(key);
    if (t == nullptr) {
      absent.emplace_back(key, e.slot);
    } else if (!t->sizes().equals(average.sizes())) {
      report.mismatched.push_back(fmt::format("{}: shape {} in the state, {} in this EMA", key,
                                              shape_string(t->sizes()), shape_string(average.sizes())));
    } else if (t->scalar_type() != average.scalar_type()) {
      report.mismatched.push_back(fmt::format("{}: dtype {} in the state, {} in this EMA", key,
                                              c10::toString(t->scalar_type()), c10::toString(average.scalar_type())));
    } else if (chosen[e.slot].first == nullptr) {
      chosen[e.slot] = {t, key};
      plan.loads.emplace_back(e.slot, t);
    } else if (!same_value(*t, *chosen[e.slot].first)) {
      // A tied tensor is saved under each name; two different values cannot both be loaded.
      report.mismatched.push_back(fmt::format("{}: differs from '{}', which is the same (tied) tensor in this EMA",
                                              key, chosen[e.slot].second));
    }
    ours.insert(std::move(key));
  }
  // A tied tensor loads from any one of its names (a state that lists it once, as a sharded
  // checkpoint or a deduplicating writer does); it is missing only when no name has it.
  for (auto& [key, slot] : absent)
    if (chosen[slot].first == nullptr) report.missing.push_back(std::move(key));
  for (const auto& item : state) {
    const auto& key = item.key();
    if (key.rfind(average_prefix, 0) == 0) {
      if (ours.count(key) == 0) report.unexpected.push_back(key);
    } else if (!known_key(key)) {
      report.unexpected.push_back(key);
    }
  }
  if (mode == LoadMode::strict && !report.clean()) fail("load_state_dict (strict): {}", describe(report));
  return plan;
}


EMAKIT_FUNC Counters read_counters(const StateDict& state) {
  const StateReader in(state);
  Counters c;
  c.calls = in.counter("counters.calls");
  c.step = in.counter("counters.step");
  c.num_updates = in.counter("counters.num_updates");
  c.last_update_step = in.counter("counters.last_update_step");
  // absent in states written before the non-finite guard existed
  c.non_finite_updates = in.find("counters.non_finite_updates") != nullptr ? in.counter("counters.non_finite_updates") : 0;
  c.last_decay = in.number("counters.last_decay");
  if (!std::isnan(c.last_decay) && !(c.last_decay >= 0.0 && c.last_decay <= 1.0))
    fail("'counters.last_decay' must be in [0, 1], got {}", c.last_decay);
  return c;
}

EMAKIT_FUNC std::string describe(const LoadReport& r) {
  std::vector<std::string> parts;
  for (const auto& k : r.missing) parts.push_back(fmt::format("missing key '{}'", k));
  for (const auto& k : r.unexpected) parts.push_back(fmt::format("unexpected key '{}'", k));
  for (const auto& k : r.mismatched) parts.push_back(k);
  return fmt::format("{}; nothing was loaded", fmt::join(parts, "; "));
}

EMAKIT_FUNC void save_archive(torch::serialize::OutputArchive& archive, const StateDict& state) {
  std::vector<std::pair<std::string, at::Tensor>> items;
  Checksums sums;
  for (const auto& item : state) {
    items.emplace_back(item.key(), item.value());
    sums.add(item.key(), item.value());
  }
  archive.write("emakit_state", tensor_dict(items, /*copy=*/false));
  archive.write("emakit_checksums", tensor_dict(sums.saved, /*copy=*/false));
  archive.write("emakit_version", c10::IValue(std::string(version_string)));  // the writer's, for messages
}

}  // namespace emakit::detail::ema_state

#endif  // EMAKIT_DEFINITIONS
