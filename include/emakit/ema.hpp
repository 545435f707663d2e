// emakit::Ema: an exponential moving average of a LibTorch model's weights.
//
//   #include <emakit/emakit.hpp>
//
//   Net model;
//   torch::optim::SGD optimizer(model->parameters(), 0.1);
//   emakit::WarmupEma ema(*model);                  // = Ema<InversePowerWarmup, StepSchedule, FlatStorage>
//   for (auto& batch : loader) {
//     ... loss.backward(); optimizer.step();
//     ema.update();                                  // after each optimizer step
//   }
//   {
//     auto swapped = ema.swap_into();                // the model now holds the EMA weights
//     evaluate(model);
//   }                                                // ... and its own weights again
//   torch::save(ema, "ema.pt");                      // config, counters and averages
//
// The Ema binds once: it keeps handles to the model's tensors and its own, grouped for the update
// kernel, so update() does no name lookups and allocates nothing. Module::to() keeps the handles
// valid (it uses set_data), but the average does not move with the model: it stays on its own
// device and in its own dtype, and the next update reads the model from wherever it went (the
// kernel re-plans once). A tensor that changes shape after binding is an error.
#pragma once

#include <emakit/concepts.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/crc32.hpp>
#include <emakit/detail/kernel.hpp>
#include <emakit/fwd.hpp>
#include <emakit/options.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>
#include <emakit/version.hpp>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit {

// A tensor to average, for an Ema bound to tensors rather than a module (a TorchScript model,
// a hand-made list). `is_buffer` decides whether EmaOptions::buffers applies to it.
struct SourceTensor {
  std::string name;
  at::Tensor tensor;
  bool is_buffer = false;
};

// What the caller tells update(): `step` when the trainer counts steps itself (timm passes its
// optimizer step), `vetoed` when the optimizer skipped this step (gradient-scaler overflow).
struct StepInfo {
  std::optional<std::int64_t> step = std::nullopt;
  bool vetoed = false;
};

// What update() did, the step it completed, and the decay it used (0 for a copy, NaN for a skip).
// With EmaOptions::skip_non_finite, `non_finite` names the first source tensor that held a NaN or
// an infinity; the update was then skipped.
struct UpdateResult {
  Action action = Action::skipped;
  std::int64_t step = 0;
  double decay = std::nan("");
  std::string non_finite = {};
};

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

// The version of the state-dict layout below; stored as "emakit.format".
inline constexpr std::int64_t state_format_version = 1;

// Holds the EMA weights in the model for its scope and restores the model's own weights when the
// scope ends, also when it ends by an exception. Made by Ema::swap_into().
class SwapGuard {
 public:
  SwapGuard(const SwapGuard&) = delete;
  SwapGuard& operator=(const SwapGuard&) = delete;
  SwapGuard(SwapGuard&& other) noexcept
      : depth_(std::move(other.depth_)), targets_(std::move(other.targets_)), backup_(std::move(other.backup_)) {}
  SwapGuard& operator=(SwapGuard&&) = delete;
  ~SwapGuard() { restore(); }

  // Puts the model's own weights back now (the destructor then does nothing).
  void restore() noexcept {
    if (!depth_) return;
    c10::NoGradGuard no_grad;
    for (std::size_t i = 0; i < targets_.size(); ++i) {
      try {
        targets_[i].copy_(backup_[i]);
      } catch (...) {  // a destructor must not throw; the copy of a same-shaped tensor cannot fail short of OOM
      }
    }
    --*depth_;
    depth_.reset();
    targets_.clear();
    backup_.clear();
  }

  bool active() const noexcept { return static_cast<bool>(depth_); }

 private:
  template <DecayPolicy, SchedulePolicy, StoragePolicy>
  friend class Ema;
  SwapGuard(std::shared_ptr<int> depth, std::vector<at::Tensor> targets, std::vector<at::Tensor> backup)
      : depth_(std::move(depth)), targets_(std::move(targets)), backup_(std::move(backup)) {}

  std::shared_ptr<int> depth_;
  std::vector<at::Tensor> targets_;
  std::vector<at::Tensor> backup_;
};

namespace detail {

inline std::vector<SourceTensor> collect(const torch::nn::Module& model) {
  std::vector<SourceTensor> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) out.push_back({item.key(), item.value(), false});
  for (const auto& item : model.named_buffers(/*recurse=*/true)) out.push_back({item.key(), item.value(), true});
  return out;
}

inline std::unordered_map<std::string, at::Tensor> tensors_by_name(const torch::nn::Module& model) {
  std::unordered_map<std::string, at::Tensor> out;
  for (auto& t : collect(model)) out.emplace(std::move(t.name), std::move(t.tensor));
  return out;
}

template <class P>
std::string_view policy_name() {
  if constexpr (requires { P::name; })
    return P::name;
  else
    return "custom";
}

template <class P>
std::vector<Field> policy_fields(const P& p) {
  if constexpr (requires { { p.fields() } -> std::same_as<std::vector<Field>>; })
    return p.fields();
  else
    return {};
}

inline at::Tensor string_tensor(std::string_view s) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(s.size())}, at::TensorOptions().dtype(at::kByte));
  std::copy(s.begin(), s.end(), reinterpret_cast<char*>(t.data_ptr<std::uint8_t>()));
  return t;
}

// true while an Ema is bound; a move leaves false behind, so a moved-from Ema is detected.
// The checksum of a tensor as saved: CRC-32 of its dtype, shape and bytes. LibTorch's archive
// reader does not check the zip format's own CRC-32s, so emakit's checkpoints keep one per tensor.
inline std::int64_t tensor_checksum(const at::Tensor& t) {
  const at::Tensor c = t.detach().cpu().contiguous();
  std::uint32_t crc = 0;
  const auto type = static_cast<std::int32_t>(c.scalar_type());
  crc = crc32(&type, sizeof(type), crc);
  for (const std::int64_t d : c.sizes()) crc = crc32(&d, sizeof(d), crc);
  crc = crc32(c.data_ptr(), c.nbytes(), crc);
  return static_cast<std::int64_t>(crc);
}

// A name -> tensor dictionary for an archive; `copy`: the archive keeps copies, unchanged when
// training goes on (else it refers to the tensors themselves, fine for an immediate save).
inline c10::IValue tensor_dict(const std::vector<std::pair<std::string, at::Tensor>>& items, bool copy = true) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [k, t] : items) dict.insert(k, copy ? t.detach().clone() : t);
  return c10::IValue(dict);
}

// The dictionary of tensor_dict() under `key`; nullopt when the archive has no such key.
inline std::optional<std::vector<std::pair<std::string, at::Tensor>>> read_tensor_dict(
    torch::serialize::InputArchive& archive, const std::string& key, const std::string& where) {
  c10::IValue value;
  if (!archive.try_read(key, value)) return std::nullopt;
  if (!value.isGenericDict()) fail("{}: '{}' is not a dictionary of tensors; the checkpoint is damaged", where, key);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor())
      fail("{}: '{}' holds a non-tensor entry; the checkpoint is damaged", where, key);
    out.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
  }
  return out;
}

// Checksums by name: collected while saving (written with tensor_dict()), read back and checked
// while loading, before anything is written.
struct Checksums {
  std::vector<std::pair<std::string, at::Tensor>> saved;
  std::unordered_map<std::string, std::int64_t> read;

  void add(const std::string& name, const at::Tensor& t) {
    saved.emplace_back(name, at::scalar_tensor(tensor_checksum(t), at::kLong));
  }
  void load(torch::serialize::InputArchive& archive, const std::string& key, const std::string& where) {
    auto items = read_tensor_dict(archive, key, where);
    if (!items)
      fail("{}: the checkpoint has no '{}'; it is damaged, or was written before emakit kept checksums", where, key);
    for (const auto& [name, t] : *items) {
      if (t.numel() != 1 || t.scalar_type() != at::kLong)
        fail("{}: checksum '{}' is not one int64; the checkpoint is damaged", where, name);
      read.emplace(name, t.item<std::int64_t>());
    }
  }
  void check(const std::string& name, const at::Tensor& t, const std::string& where) const {
    auto it = read.find(name);
    if (it == read.end())
      fail("{}: the checkpoint has no checksum for '{}'; it is damaged or was not written by emakit", where, name);
    if (it->second != tensor_checksum(t))
      fail("{}: '{}' does not match its checksum; the checkpoint is damaged", where, name);
  }
};

struct BoundFlag {
  bool value = false;
  BoundFlag() = default;
  BoundFlag(BoundFlag&& other) noexcept : value(std::exchange(other.value, false)) {}
  BoundFlag& operator=(BoundFlag&& other) noexcept {
    value = std::exchange(other.value, false);
    return *this;
  }
  BoundFlag& operator=(bool v) noexcept {
    value = v;
    return *this;
  }
  explicit operator bool() const noexcept { return value; }
};

inline std::string tensor_string(const at::Tensor& t) {
  if (t.scalar_type() != at::kByte || t.dim() != 1) return "<not a string>";
  const auto c = t.contiguous();
  const auto* p = c.data_ptr<std::uint8_t>();
  return std::string(p, p + c.numel());
}

inline std::string value_string(double v, bool is_integer) {
  return is_integer ? fmt::format("{}", static_cast<std::int64_t>(v)) : fmt::format("{}", v);
}

}  // namespace detail

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
class Ema {
 public:
  using decay_type = Decay;
  using schedule_type = Schedule;
  using storage_type = Storage;

  // Binds to every parameter and buffer of `model` (names as in its state dict).
  explicit Ema(const torch::nn::Module& model, Decay decay = Decay(), Schedule schedule = Schedule(),
               EmaOptions options = EmaOptions(), Storage storage = Storage())
      : Ema(&model, detail::collect(model), std::move(decay), std::move(schedule), std::move(options),
            std::move(storage)) {}

  // Binds to a list of named tensors (e.g. a TorchScript module's parameters).
  explicit Ema(std::vector<SourceTensor> tensors, Decay decay = Decay(), Schedule schedule = Schedule(),
               EmaOptions options = EmaOptions(), Storage storage = Storage())
      : Ema(nullptr, std::move(tensors), std::move(decay), std::move(schedule), std::move(options),
            std::move(storage)) {}

  Ema(const Ema&) = delete;
  Ema& operator=(const Ema&) = delete;
  // Moving is allowed (a SwapGuard stays valid: it refers to the same tensors); the moved-from
  // Ema refuses every call with an error that says so.
  Ema(Ema&&) noexcept = default;
  Ema& operator=(Ema&&) noexcept = default;
  ~Ema() = default;

  // ---- the update ------------------------------------------------------------------------

  // Call after each optimizer step (each micro-batch with an accumulation window). The schedule
  // decides whether this call skips, copies the model, or averages; the decay policy gives d.
  UpdateResult update(StepInfo info = {}) {
    ensure_bound("update");
    if (*swap_depth_ > 0)
      detail::fail("update() while a SwapGuard holds the EMA weights in the model would average the EMA with "
                   "itself; end the guard's scope (or call restore()) first");
    const ScheduleInput in{calls_ + 1, info.step, step_, num_updates_, info.vetoed};
    const Decision decision = schedule_.decide(in);
    UpdateResult result{decision.action, decision.step, std::nan(""), {}};
    if (decision.action != Action::skipped && options_.skip_non_finite()) {
      for (const auto& s : kernel_.slots()) {
        const bool read = decision.action == Action::copied || s.averaged || s.follows_averages;
        if (read && !detail::all_finite(s.source)) {
          result.non_finite = s.name;
          break;
        }
      }
      if (!result.non_finite.empty()) {
        TORCH_WARN("emakit: update at step ", decision.step, " skipped: '", result.non_finite,
                   "' holds a NaN or an infinity (EmaOptions::skip_non_finite); the average is unchanged");
        calls_ += 1;
        step_ = decision.step;
        non_finite_updates_ += 1;
        last_non_finite_ = result.non_finite;
        result.action = Action::skipped;
        return result;
      }
    }
    if (decision.action == Action::copied) {
      kernel_.check_sources();
      kernel_.copy();
      result.decay = 0.0;
    } else if (decision.action == Action::averaged) {
      const DecayInput d_in{decision.step, num_updates_ + 1, decision.step - last_update_step_};
      const double weight = lerp_weight(d_in);
      kernel_.check_sources();
      kernel_.average(weight);
      result.decay = 1.0 - weight;
    }
    if (options_.switch_every() > 0 && decision.action != Action::copied && !info.vetoed &&
        (decision.step - options_.switch_offset()) % options_.switch_every() == 0)
      switch_model(options_.switch_beta());
    // Counters change only after the kernel succeeded: a failed update leaves the EMA as it was.
    calls_ += 1;
    step_ = decision.step;
    if (decision.action != Action::skipped) {
      num_updates_ += 1;
      last_update_step_ = decision.step;
      last_decay_ = result.decay;
    }
    return result;
  }

  // With EmaOptions::side_stream: orders the current CUDA stream (and the host, for a CPU
  // average) after the last update. Call it before the next optimizer step writes the model;
  // reads of the average wait by themselves. Without a side stream it does nothing.
  void wait() const {
    ensure_bound("wait");
    kernel_.wait();
  }

  // ---- counters and parts -------------------------------------------------------------------

  std::int64_t calls() const noexcept { return calls_; }                // update() calls seen
  std::int64_t step() const noexcept { return step_; }                  // last completed step
  std::int64_t num_updates() const noexcept { return num_updates_; }    // copies + averages applied
  std::int64_t last_update_step() const noexcept { return last_update_step_; }
  double decay() const noexcept { return last_decay_; }                 // d of the last applied update
  // Updates skipped because the model held a NaN or an infinity (EmaOptions::skip_non_finite),
  // and the tensor named by the last of them.
  std::int64_t non_finite_updates() const noexcept { return non_finite_updates_; }
  const std::string& last_non_finite() const noexcept { return last_non_finite_; }

  const Decay& decay_policy() const noexcept { return decay_; }
  const Schedule& schedule() const noexcept { return schedule_; }
  const Storage& storage() const noexcept { return storage_; }
  const EmaOptions& options() const noexcept { return options_; }

  // The EMA module, for a module-backed storage.
  decltype(auto) module() const
    requires requires(const Storage& s) { s.module(); }
  {
    ensure_bound("module");
    return storage_.module();
  }

  // The averaged and copied tensors by name, in the model's order. They are the EMA's own tensors.
  StateDict averages() const {
    ensure_bound("averages");
    StateDict out;
    for (const auto& s : kernel_.slots()) out.insert(s.name, s.average);
    return out;
  }

  // The EMA tensor named `name` (as in the model's state dict).
  const at::Tensor& average(const std::string& name) const {
    ensure_bound("average");
    for (const auto& s : kernel_.slots())
      if (s.name == name) return s.average;
    detail::fail("the EMA has no tensor '{}' (ignored, or not in the model)", name);
  }

  // Names of the tensors the EMA holds in a role (Role::ignore: none, it holds no such tensor).
  std::vector<std::string> names(Role role) const {
    std::vector<std::string> out;
    for (const auto& s : kernel_.slots()) {
      const Role r = s.averaged ? Role::average : s.follows_averages ? Role::copy : Role::follow_copies;
      if (r == role) out.push_back(s.name);
    }
    return out;
  }

  // ---- moving weights between the EMA and a model ------------------------------------------

  // Writes the EMA weights into `model` (matched by name; every EMA tensor must be there).
  void copy_to(torch::nn::Module& model) const { transfer(model, /*into_model=*/true); }
  // Overwrites the EMA weights with `model`'s; counters are unchanged.
  void copy_from(const torch::nn::Module& model) { transfer(model, /*into_model=*/false); }

  // Pulls the bound model towards the EMA ("switch EMA"): model = lerp(model, ema, 1 - beta) for
  // averaged tensors, model = ema for copied ones; beta = 0 copies every tensor the EMA holds.
  // update() calls it by itself when EmaOptions::switch_model is set.
  void switch_model(double beta) {
    ensure_bound("switch_model");
    detail::check_unit_interval(beta, "switch_model beta");
    c10::NoGradGuard no_grad;
    for (const auto& s : kernel_.slots()) {
      if (beta == 0.0) {
        s.source.copy_(s.average);
      } else if (s.averaged) {
        s.source.lerp_(s.average.to(s.source.options()), 1.0 - beta);
      } else if (s.follows_averages) {
        s.source.copy_(s.average);
      }
    }
  }

  // Puts the EMA weights into the bound model until the guard's scope ends.
  [[nodiscard]] SwapGuard swap_into() {
    ensure_bound("swap_into");
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> targets, backup;
    targets.reserve(kernel_.slots().size());
    backup.reserve(kernel_.slots().size());
    for (const auto& s : kernel_.slots()) {
      targets.push_back(s.source);
      backup.push_back(s.source.detach().clone());
    }
    ++*swap_depth_;
    SwapGuard guard(swap_depth_, std::move(targets), std::move(backup));
    for (std::size_t i = 0; i < kernel_.slots().size(); ++i) kernel_.slots()[i].source.copy_(kernel_.slots()[i].average);
    return guard;
  }

  // ---- state ------------------------------------------------------------------------------

  // Config, counters and averaged tensors. Keys:
  //   emakit.format                       int64, the layout version
  //   config.decay / config.schedule      the policy's name, as uint8 UTF-8 bytes
  //   config.decay.<field>, config.schedule.<field>   float64 option values
  //   counters.calls, counters.step, counters.num_updates, counters.last_update_step   int64
  //   counters.last_decay                 float64
  //   average.<name>                      the EMA's tensors (shared, not copied)
  StateDict state_dict() const {
    ensure_bound("state_dict");
    StateDict out;
    out.insert("emakit.format", at::scalar_tensor(state_format_version, at::kLong));
    write_config(out, "decay", decay_);
    write_config(out, "schedule", schedule_);
    out.insert("counters.calls", at::scalar_tensor(calls_, at::kLong));
    out.insert("counters.step", at::scalar_tensor(step_, at::kLong));
    out.insert("counters.num_updates", at::scalar_tensor(num_updates_, at::kLong));
    out.insert("counters.last_update_step", at::scalar_tensor(last_update_step_, at::kLong));
    out.insert("counters.last_decay", at::scalar_tensor(last_decay_, at::kDouble));
    out.insert("counters.non_finite_updates", at::scalar_tensor(non_finite_updates_, at::kLong));
    for (const auto& s : kernel_.slots()) out.insert("average." + s.name, s.average);
    return out;
  }

  // Loads a state_dict() of an EMA with the same config. A config that differs is an error that
  // names the field and both values. Everything is checked before anything is written: a failed
  // load leaves the EMA exactly as it was.
  LoadReport load_state_dict(const StateDict& state, LoadMode mode = LoadMode::strict) {
    ensure_bound("load_state_dict");
    LoadPlan plan = plan_load(state, mode);
    if (mode == LoadMode::lenient) {
      for (const auto& k : plan.report.missing) TORCH_WARN("emakit: load_state_dict: missing key '", k, "', kept the current value");
      for (const auto& k : plan.report.unexpected) TORCH_WARN("emakit: load_state_dict: unexpected key '", k, "', ignored");
      for (const auto& k : plan.report.mismatched) TORCH_WARN("emakit: load_state_dict: ", k, "; kept the current value");
    }
    {
      c10::NoGradGuard no_grad;
      for (const auto& [i, t] : plan.loads) kernel_.slots()[i].average.copy_(*t);
    }
    calls_ = plan.counters.calls;
    step_ = plan.counters.step;
    num_updates_ = plan.counters.num_updates;
    last_update_step_ = plan.counters.last_update_step;
    last_decay_ = plan.counters.last_decay;
    non_finite_updates_ = plan.counters.non_finite_updates;
    return plan.report;
  }

  // Every check of load_state_dict() and nothing written: throws where it would throw, returns
  // the report it would return. Lets a caller that loads several things check them all first.
  LoadReport check_state_dict(const StateDict& state, LoadMode mode = LoadMode::strict) const {
    ensure_bound("check_state_dict");
    return plan_load(state, mode).report;
  }

  // For an EMA made after its trainer had already run (a hook that creates it lazily): counts
  // `calls` update() calls and `step` completed steps as already seen, so that update_every,
  // start_step and accumulation windows continue where the trainer is. Only before any update.
  void advance(std::int64_t calls, std::int64_t step) {
    ensure_bound("advance");
    if (calls_ != 0 || num_updates_ != 0)
      detail::fail("advance() on an EMA that has already seen {} update() calls; it is only for a new EMA", calls_);
    detail::check_non_negative_int(calls, "advance() calls");
    detail::check_non_negative_int(step, "advance() step");
    calls_ = calls;
    step_ = step;
  }

  // Archive operators (torch::save(ema, path) / torch::load(ema, path)) live below the class.
  // The archive holds the state dict and a CRC-32 per tensor ("emakit_checksums"), checked by
  // load(): a damaged file is an error, never a different average.
  void save(torch::serialize::OutputArchive& archive) const {
    std::vector<std::pair<std::string, at::Tensor>> items;
    detail::Checksums sums;
    for (const auto& item : state_dict()) {
      items.emplace_back(item.key(), item.value());
      sums.add(item.key(), item.value());
    }
    archive.write("emakit_state", detail::tensor_dict(items, /*copy=*/false));
    archive.write("emakit_checksums", detail::tensor_dict(sums.saved, /*copy=*/false));
    archive.write("emakit_version", c10::IValue(std::string(version_string)));  // the writer's, for messages
  }
  void load(torch::serialize::InputArchive& archive, LoadMode mode = LoadMode::strict) {
    const std::string where = "torch::load(ema)";
    auto items = detail::read_tensor_dict(archive, "emakit_state", where);
    if (!items)
      detail::fail("the archive holds no emakit state (no 'emakit_state' dictionary); was it written by "
                   "torch::save(ema, ...)?");
    detail::Checksums sums;
    sums.load(archive, "emakit_checksums", where);
    StateDict state;
    for (const auto& [key, t] : *items) {
      sums.check(key, t, where);
      state.insert(key, t);
    }
    if (state.size() != sums.read.size())
      detail::fail("{}: the archive holds {} checksums for {} tensors; the checkpoint is damaged", where,
                   sums.read.size(), state.size());
    try {
      load_state_dict(state, mode);
    } catch (const std::invalid_argument& e) {
      c10::IValue writer;
      if (!archive.try_read("emakit_version", writer) || !writer.isString()) throw;
      throw std::invalid_argument(fmt::format("{} (the file was written by emakit {})", e.what(), writer.toStringRef()));
    }
  }

 private:
  struct Counters {
    std::int64_t calls, step, num_updates, last_update_step;
    double last_decay;
    std::int64_t non_finite_updates = 0;
  };

  struct LoadPlan {
    LoadReport report;
    std::vector<std::pair<std::size_t, const at::Tensor*>> loads;  // slot index, tensor to copy in
    Counters counters;
  };

  LoadPlan plan_load(const StateDict& state, LoadMode mode) const {
    check_format(state);
    check_config(state, "decay", decay_);
    check_config(state, "schedule", schedule_);
    LoadPlan plan{{}, {}, read_counters(state)};
    LoadReport& report = plan.report;
    for (std::size_t i = 0; i < kernel_.slots().size(); ++i) {
      const auto& s = kernel_.slots()[i];
      const std::string key = "average." + s.name;
      const at::Tensor* t = state.find(key);
      if (t == nullptr) {
        report.missing.push_back(key);
      } else if (!t->sizes().equals(s.average.sizes())) {
        report.mismatched.push_back(fmt::format("{}: shape {} in the state, {} in this EMA", key,
                                                detail::shape_string(t->sizes()),
                                                detail::shape_string(s.average.sizes())));
      } else if (t->scalar_type() != s.average.scalar_type()) {
        report.mismatched.push_back(fmt::format("{}: dtype {} in the state, {} in this EMA", key,
                                                c10::toString(t->scalar_type()),
                                                c10::toString(s.average.scalar_type())));
      } else {
        plan.loads.emplace_back(i, t);
      }
    }
    for (const auto& item : state) {
      const auto& key = item.key();
      if (key.rfind("average.", 0) == 0) {
        const std::string name = key.substr(8);
        bool ours = false;
        for (const auto& s : kernel_.slots()) ours = ours || s.name == name;
        if (!ours) report.unexpected.push_back(key);
      } else if (!known_key(key)) {
        report.unexpected.push_back(key);
      }
    }
    if (mode == LoadMode::strict && !report.clean()) detail::fail("load_state_dict (strict): {}", describe(report));
    return plan;
  }

  Ema(const torch::nn::Module* model, std::vector<SourceTensor> tensors, Decay decay, Schedule schedule,
      EmaOptions options, Storage storage)
      : decay_(std::move(decay)),
        schedule_(std::move(schedule)),
        storage_(std::move(storage)),
        options_(std::move(options)),
        swap_depth_(std::make_shared<int>(0)) {
    bind(model, std::move(tensors));
  }

  void bind(const torch::nn::Module* model, std::vector<SourceTensor> tensors) {
    std::vector<std::string> all_names;
    all_names.reserve(tensors.size());
    for (const auto& t : tensors) {
      if (!t.tensor.defined()) detail::fail("tensor '{}' is undefined; bind an Ema to defined tensors", t.name);
      all_names.push_back(t.name);
    }
    for (std::size_t i = 0; i < all_names.size(); ++i)
      for (std::size_t j = i + 1; j < all_names.size(); ++j)
        if (all_names[i] == all_names[j]) detail::fail("tensor name '{}' appears twice", all_names[i]);
    options_.check_names(all_names);

    std::vector<TensorSpec> specs;
    std::vector<Role> roles;
    for (auto& t : tensors) {
      const auto dtype = t.tensor.scalar_type();
      const bool floating = c10::isFloatingType(dtype) || c10::isComplexType(dtype);
      const Role role = options_.role(t.name, t.is_buffer, floating);
      if (role == Role::ignore) continue;
      const auto device = options_.device().value_or(t.tensor.device());
      specs.push_back({t.name, t.tensor, role == Role::average ? options_.average_dtype(dtype) : dtype, device});
      roles.push_back(role);
    }
    std::vector<at::Tensor> own = storage_.create(model, std::span<const TensorSpec>(specs));
    if (own.size() != specs.size())
      detail::fail("storage {} made {} tensors for {} specs", detail::policy_name<Storage>(), own.size(), specs.size());
    std::vector<detail::Slot> slots;
    slots.reserve(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) {
      if (!own[i].defined()) continue;  // held elsewhere (ShardedStorage: by another rank)
      detail::Slot slot;
      slot.name = specs[i].name;
      slot.average = own[i];
      slot.source = specs[i].source;
      slot.averaged = roles[i] == Role::average;
      slot.follows_averages = roles[i] != Role::follow_copies;
      slots.push_back(std::move(slot));
    }
    kernel_ = detail::UpdateKernel(std::move(slots), detail::UpdateKernel::CpuPath::fused, options_.side_stream());
    bound_ = true;
  }

  void ensure_bound(const char* what) const {
    if (!bound_) detail::fail("{}() on a moved-from Ema; use the Ema it was moved into", what);
  }

  double lerp_weight(const DecayInput& in) const {
    double w;
    if constexpr (HasLerpWeight<Decay>)
      w = static_cast<double>(decay_.weight(in));
    else
      w = 1.0 - static_cast<double>(decay_.decay(in));
    if (!(w >= 0.0 && w <= 1.0))
      detail::fail("decay policy {} gave d = {} at step {} (update {}); d must be in [0, 1]",
                   detail::policy_name<Decay>(), 1.0 - w, in.step, in.update);
    return w;
  }

  // The model's tensors are handles: writing into them through a const Module is what
  // Module::load does too.
  void transfer(const torch::nn::Module& model, bool into_model) const {
    ensure_bound(into_model ? "copy_to" : "copy_from");
    auto theirs = detail::tensors_by_name(model);
    std::vector<std::pair<const detail::Slot*, at::Tensor>> pairs;
    for (const auto& s : kernel_.slots()) {
      auto it = theirs.find(s.name);
      if (it == theirs.end()) detail::fail("the model has no tensor '{}' that the EMA holds", s.name);
      if (!it->second.sizes().equals(s.average.sizes()))
        detail::fail("tensor '{}' has shape {} in the model but {} in the EMA", s.name,
                     detail::shape_string(it->second.sizes()), detail::shape_string(s.average.sizes()));
      pairs.emplace_back(&s, it->second);
    }
    c10::NoGradGuard no_grad;
    for (auto& [s, t] : pairs) {
      if (into_model)
        t.copy_(s->average);
      else
        s->average.copy_(t);
    }
  }

  template <class P>
  static void write_config(StateDict& out, const std::string& axis, const P& p) {
    out.insert("config." + axis, detail::string_tensor(detail::policy_name<P>()));
    for (const auto& f : detail::policy_fields(p))
      out.insert("config." + axis + "." + std::string(f.name), at::scalar_tensor(f.value, at::kDouble));
  }

  static bool known_key(const std::string& key) {
    static const char* const fixed[] = {"emakit.format",        "counters.calls",           "counters.step",
                                        "counters.num_updates", "counters.last_update_step", "counters.last_decay",
                                        "counters.non_finite_updates"};
    for (const char* k : fixed)
      if (key == k) return true;
    // check_config() has checked every key under these two already.
    return key == "config.decay" || key == "config.schedule" || key.rfind("config.decay.", 0) == 0 ||
           key.rfind("config.schedule.", 0) == 0;
  }

  static void check_format(const StateDict& state) {
    const at::Tensor* f = state.find("emakit.format");
    if (f == nullptr) detail::fail("the state has no 'emakit.format' entry; it is not an emakit EMA state");
    if (f->numel() != 1 || f->item<std::int64_t>() != state_format_version)
      detail::fail("the state's emakit.format is {}, this emakit ({}) reads format {}",
                   f->numel() == 1 ? fmt::format("{}", f->item<std::int64_t>()) : std::string("not a number"),
                   version_string, state_format_version);
  }

  template <class P>
  static void check_config(const StateDict& state, const std::string& axis, const P& p) {
    const std::string kind_key = "config." + axis;
    const at::Tensor* kind = state.find(kind_key);
    const auto ours = detail::policy_name<P>();
    if (kind == nullptr) detail::fail("the state has no '{}' (this EMA's {} policy is {})", kind_key, axis, ours);
    const std::string theirs = detail::tensor_string(*kind);
    if (theirs != ours)
      detail::fail("config differs: {} policy is {} in the state, {} in this EMA", axis, theirs, ours);
    const auto fields = detail::policy_fields(p);
    for (const auto& f : fields) {
      const std::string key = kind_key + "." + std::string(f.name);
      const at::Tensor* t = state.find(key);
      if (t == nullptr) detail::fail("config differs: the state has no '{}'", key);
      const double v = t->item<double>();
      if (v != f.value)
        detail::fail("config differs: {} is {} in the state, {} in this EMA", key,
                     detail::value_string(v, f.is_integer), detail::value_string(f.value, f.is_integer));
    }
    const std::string prefix = kind_key + ".";
    for (const auto& item : state) {
      if (item.key().rfind(prefix, 0) != 0) continue;
      const std::string name = item.key().substr(prefix.size());
      bool ours_has = false;
      for (const auto& f : fields) ours_has = ours_has || f.name == name;
      if (!ours_has) detail::fail("config differs: the state has '{}', which {} does not have", item.key(), ours);
    }
  }

  static Counters read_counters(const StateDict& state) {
    auto integer = [&](const char* key) {
      const at::Tensor* t = state.find(key);
      if (t == nullptr) detail::fail("the state has no '{}'", key);
      if (t->numel() != 1 || c10::isFloatingType(t->scalar_type()))
        detail::fail("'{}' must be one integer, got a {} tensor of shape {}", key, c10::toString(t->scalar_type()),
                     detail::shape_string(t->sizes()));
      const auto v = t->item<std::int64_t>();
      if (v < 0) detail::fail("'{}' must be >= 0, got {}", key, v);
      return v;
    };
    Counters c{integer("counters.calls"), integer("counters.step"), integer("counters.num_updates"),
               integer("counters.last_update_step"), 0.0,
               // absent in states written before the non-finite guard existed
               state.find("counters.non_finite_updates") != nullptr ? integer("counters.non_finite_updates") : 0};
    const at::Tensor* d = state.find("counters.last_decay");
    if (d == nullptr) detail::fail("the state has no 'counters.last_decay'");
    if (d->numel() != 1) detail::fail("'counters.last_decay' must be one number, got shape {}", detail::shape_string(d->sizes()));
    c.last_decay = d->item<double>();
    if (!std::isnan(c.last_decay) && !(c.last_decay >= 0.0 && c.last_decay <= 1.0))
      detail::fail("'counters.last_decay' must be in [0, 1], got {}", c.last_decay);
    return c;
  }

  static std::string describe(const LoadReport& r) {
    std::vector<std::string> parts;
    for (const auto& k : r.missing) parts.push_back(fmt::format("missing key '{}'", k));
    for (const auto& k : r.unexpected) parts.push_back(fmt::format("unexpected key '{}'", k));
    for (const auto& k : r.mismatched) parts.push_back(k);
    return fmt::format("{}; nothing was loaded", fmt::join(parts, "; "));
  }

  Decay decay_;
  Schedule schedule_;
  Storage storage_;
  EmaOptions options_;
  detail::UpdateKernel kernel_;
  std::shared_ptr<int> swap_depth_;
  std::int64_t calls_ = 0;
  std::int64_t step_ = 0;
  std::int64_t num_updates_ = 0;
  std::int64_t last_update_step_ = 0;
  double last_decay_ = std::nan("");
  std::int64_t non_finite_updates_ = 0;
  std::string last_non_finite_;
  detail::BoundFlag bound_;
};

// The policies and options of an Ema before it exists: what a trainer hook (hooks.hpp) keeps
// until it makes the EMA, and what it asks the schedule before then.
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
struct Recipe {
  using ema_type = Ema<D, S, St>;

  explicit Recipe(D d = D(), S s = S(), EmaOptions o = EmaOptions(), St st = St())
      : decay(std::move(d)), schedule(std::move(s)), options(std::move(o)), storage(std::move(st)) {}

  ema_type make(const torch::nn::Module& model) const { return ema_type(model, decay, schedule, options, storage); }

  D decay;
  S schedule;
  EmaOptions options;
  St storage;
};

// torch::save(ema, path) and torch::load(ema, path).
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const Ema<D, S, St>& ema) {
  ema.save(archive);
  return archive;
}
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, Ema<D, S, St>& ema) {
  ema.load(archive);
  return archive;
}

}  // namespace emakit
