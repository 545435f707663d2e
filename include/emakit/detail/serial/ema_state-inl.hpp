// The non-template definitions of ema_state.hpp: included at the end of ema_state.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/ema_state-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/ema_state.hpp> instead"
#endif

#include <emakit/detail/serial/ema_state.hpp>

#include <fmt/format.h>  // fmt::join
#include <fmt/ranges.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC std::string custom_policy_name(std::string demangled) {
  // Only this program's mode namespace can be in the name (one mode per program).
  constexpr std::string_view mode = "emakit::" EMAKIT_ABI_NAMESPACE_NAME "::";
  for (auto at = demangled.find(mode); at != std::string::npos; at = demangled.find(mode, at))
    demangled.replace(at, mode.size(), "emakit::");
  return "custom:" + demangled;
}

EMAKIT_FUNC std::string value_string(double v, bool is_integer) {
  return is_integer ? fmt::format("{}", static_cast<std::int64_t>(v)) : fmt::format("{}", v);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::ema_state {

EMAKIT_FUNC std::string average_key(const std::string& name) { return std::string(average_prefix) + name; }

EMAKIT_FUNC bool known_key(const std::string& key) {
  if (key == "config.options.buffers" || key == "config.options.arithmetic") return true;  // check_config()
  if (key == "emakit.format" || key == last_decay_key) return true;
  for (const auto& counter : integer_counters)
    if (key == counter.key) return true;
  // check_policy() has checked every key under these two already.
  return key == "config.decay" || key == "config.schedule" || key.rfind("config.decay.", 0) == 0 ||
         key.rfind("config.schedule.", 0) == 0;
}

EMAKIT_FUNC void check_format(const StateDict& state) {
  const auto format = StateReader(state).optional_integer("emakit.format");
  if (!format) fail("the state has no 'emakit.format' entry; it is not an emakit EMA state");
  formats::check_version(formats::ema_state, *format, "the state's emakit.format");
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
  out.insert("config.options.arithmetic", string_tensor(arithmetic_name(options.arithmetic())));
  write_counters(out, c);
  return out;
}

EMAKIT_FUNC void write_counters(StateDict& out, const Counters& c) {
  for (const auto& counter : integer_counters)
    out.insert(std::string(counter.key), at::scalar_tensor(c.*counter.member, at::kLong));
  out.insert(std::string(last_decay_key), at::scalar_tensor(c.last_decay, at::kDouble));
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
    const double v = number_value(*t, key);
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
      return v == 0   ? std::string("average")
             : v == 1 ? std::string("copy")
             : v == 2 ? std::string("ignore")
                      : fmt::format("{} (unknown)", v);
    };
    const auto ours = static_cast<std::int64_t>(options.buffers());
    if (*theirs != ours)
      fail("config differs: config.options.buffers (EmaOptions::buffers) is {} in the state, {} in this EMA",
           name(*theirs), name(ours));
  }
  // A state from before the key was written loads into any arithmetic, as one without the buffer
  // mode does: its averages are a lerp's, and a preset's EMA resumed from it goes on with its own.
  if (const auto theirs = StateReader(state).optional_text("config.options.arithmetic")) {
    const std::string_view ours = arithmetic_name(options.arithmetic());
    if (*theirs != ours)
      fail("config differs: config.options.arithmetic (EmaOptions::arithmetic) is {} in the state, {} in this EMA: "
           "its averages were computed another way (a checkpoint of another preset's EMA?)",
           *theirs, ours);
  }
}

EMAKIT_FUNC Plan plan_load(const StateDict& state, LoadMode mode, const PolicyConfig& config, const EmaOptions& options,
                           const std::vector<Entry>& entries, const std::vector<at::Tensor>& averages,
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
      report.mismatched.push_back(fmt::format("{}: differs from '{}', which is the same (tied) tensor in this EMA", key,
                                              chosen[e.slot].second));
    }
    ours.insert(std::move(key));
  }
  // A tied tensor loads from any one of its names (a state that lists it once, as a sharded
  // checkpoint or a deduplicating writer does); it is missing only when no name has it.
  for (auto& [key, slot] : absent)
    if (chosen[slot].first == nullptr) report.missing.push_back(std::move(key));
  for (const auto& item : state) {
    const auto& key = item.key();
    if (is_average_key(key)) {
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
  for (const auto& counter : integer_counters) {
    const std::string key(counter.key);
    if (counter.key != optional_counter_key || in.find(key) != nullptr) c.*counter.member = in.counter(key);
  }
  c.last_decay = in.number(std::string(last_decay_key));
  if (!std::isnan(c.last_decay) && !(c.last_decay >= 0.0 && c.last_decay <= 1.0))
    fail("'{}' must be in [0, 1], got {}", last_decay_key, c.last_decay);
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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::ema_state
