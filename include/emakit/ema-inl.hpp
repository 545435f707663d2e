// The definitions of ema.hpp's non-template code: emakit::EmaBase, the part of every Ema that does
// not depend on its policies' types, and the helpers it uses. Included at the end of ema.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/ema-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/ema.hpp> instead"
#endif

#include <emakit/ema.hpp>

#include <ATen/core/Generator.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <unordered_set>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

namespace detail {

// The state of every default random generator (the CPU's, and each CUDA device's where LibTorch
// has CUDA), put back when this goes out of scope: Python's torch.random.fork_rng. Making the
// EMA's storage draws from them where the user's code does not expect it (a Cloneable module's
// clone() runs reset(), which initializes the copy's parameters before the model's are copied in;
// a factory builds a fresh module), and a seeded run must be the same run with and without an
// EMA. The Python peers deep-copy the model and draw nothing. Draws that other threads make from
// the same generators meanwhile are undone with them.
class GeneratorStates {
 public:
  GeneratorStates() {
    at::Context& context = at::globalContext();
    save(context.defaultGenerator(c10::Device(c10::kCPU)));
    if (context.hasCUDA()) {
      const int devices = at::detail::getCUDAHooks().getNumGPUs();
      for (int i = 0; i < devices; ++i)
        save(context.defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))));
    }
  }
  GeneratorStates(const GeneratorStates&) = delete;
  GeneratorStates& operator=(const GeneratorStates&) = delete;
  ~GeneratorStates() {
    for (auto& [generator, state] : saved_) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
  }

 private:
  void save(at::Generator generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    at::Tensor state = generator.get_state();
    saved_.emplace_back(std::move(generator), std::move(state));
  }
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

[[noreturn]] EMAKIT_FUNC void fail_model_destroyed(const char* what) {
  fail("{}(): the model this Ema was bound to has been destroyed (a rebuilt model?), so the EMA would average, "
       "or write into, tensors that no model uses; make a new Ema for the new model, or load this EMA's state "
       "into it (new_ema.load_state_dict(ema.state_dict()), or ema.copy_to(new_model) for the weights). This "
       "EMA's own state still reads: averages(), state_dict(), save()",
       what);
}

// For each tensor, the index of the first tensor that is the same tensor (itself if none;
// first_same_view). Different views of one storage that overlap cannot be averaged independently:
// an error, unless one of them is ignored.
EMAKIT_FUNC std::vector<std::size_t> identity_groups(const std::vector<SourceTensor>& tensors,
                                                     const std::vector<Role>& roles) {
  std::vector<at::Tensor> handles;
  handles.reserve(tensors.size());
  for (const auto& t : tensors) handles.push_back(t.tensor);
  const std::vector<std::size_t> first = first_same_view(handles);
  // Per storage, one kept (not ignored) tensor of each group seen so far.
  std::unordered_map<const void*, std::vector<std::size_t>> kept;
  std::vector<bool> group_kept(tensors.size(), false);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].tensor;
    if (roles[i] == Role::ignore || !t.has_storage() || group_kept[first[i]]) continue;
    group_kept[first[i]] = true;
    auto& others = kept[t.storage().unsafeGetStorageImpl()];
    for (const std::size_t j : others)
      if (overlap(tensors[j].tensor, t))
        fail("tensors '{}' and '{}' of the model are different views of overlapping memory; an EMA cannot "
             "average them independently. Leave one out (EmaOptions::ignore)",
             tensors[j].name, tensors[i].name);
    others.push_back(i);
  }
  return first;
}

// The role of one tensor of the model, from the roles of its names: the role they agree on
// (names that ignore it do not count while another name holds it).
EMAKIT_FUNC Role group_role(const std::vector<SourceTensor>& tensors, const std::vector<Role>& roles,
                            const std::vector<std::size_t>& names) {
  std::optional<std::size_t> held;
  bool follows = false;
  for (const std::size_t i : names) {
    if (roles[i] == Role::ignore_except_copies) follows = true;
    if (roles[i] != Role::average && roles[i] != Role::copy) continue;
    if (!held) {
      held = i;
    } else if (roles[*held] != roles[i]) {
      fail("'{}' and '{}' are one tensor of the model (tied), but the options average one name and copy "
           "the other (EmaOptions::copy_only or buffers); give both names the same role",
           tensors[*held].name, tensors[i].name);
    }
  }
  if (held) return roles[*held];
  return follows ? Role::ignore_except_copies : Role::ignore;
}

EMAKIT_FUNC void check_dense(const std::string& name, const at::Tensor& t) {
  if (t.layout() != c10::kStrided)
    fail("tensor '{}' is {}; an EMA averages dense (strided) tensors only. Leave it out with "
         "EmaOptions::ignore({{\"{}\"}})",
         name,
         t.is_sparse()   ? "sparse (COO)"
         : t.is_mkldnn() ? "an MKL-DNN tensor"
                         : "not strided (sparse?)",
         name);
  if (c10::isQIntType(t.scalar_type()))
    fail("tensor '{}' is quantized ({}); an EMA averages float, complex and integer tensors only. Leave "
         "it out with EmaOptions::ignore({{\"{}\"}})",
         name, c10::toString(t.scalar_type()), name);
}

// The EMA owns its memory: no tensor a storage made may share memory with the model, and two
// tensors the model keeps apart must not overlap in the EMA (a factory's module that ties what
// the model does not tie would average one tensor twice).
EMAKIT_FUNC void check_owned(const std::vector<SourceTensor>& tensors, const std::vector<TensorSpec>& specs,
                             const std::vector<at::Tensor>& own, std::string_view storage_name) {
  ModelMemory model_memory;
  for (const auto& t : tensors) model_memory.add(t.name, t.tensor);
  std::unordered_map<const void*, std::vector<std::size_t>> own_memory;
  for (std::size_t i = 0; i < own.size(); ++i) {
    if (!own[i].defined() || !own[i].has_storage()) continue;
    const void* key = own[i].storage().unsafeGetStorageImpl();
    if (const std::string* shared = model_memory.owner(own[i]))
      fail("storage {} made, for '{}', a tensor that shares memory with the model's '{}'; an EMA must own "
           "its averages",
           storage_name, specs[i].name, *shared);
    auto& same_storage = own_memory[key];
    for (const std::size_t j : same_storage)
      if (overlap(own[j], own[i]))
        fail("storage {} made one tensor for '{}' and '{}', which the model keeps apart (does the module "
             "its factory builds tie them?); the EMA would average it twice. Make the EMA module tie "
             "exactly what the model ties",
             storage_name, specs[j].name, specs[i].name);
    same_storage.push_back(i);
  }
}

// The busy flags of update_together's members, taken in order and given back by the destructor
// (those taken, if one was refused): a BusyScope per member, without allocating one. (No anonymous
// namespace: GroupCore::update is inline with EMAKIT_HEADER_ONLY.)
class BusyAll {
 public:
  explicit BusyAll(std::span<EmaBase* const> members, BusyFlag EmaBase::*flag, const char* what)
      : members_(members), flag_(flag) {
    try {
      for (; taken_ < members_.size(); ++taken_) (members_[taken_]->*flag_).take(what);
    } catch (...) {
      give_back();  // a constructor that throws runs no destructor
      throw;
    }
  }
  BusyAll(const BusyAll&) = delete;
  BusyAll& operator=(const BusyAll&) = delete;
  ~BusyAll() { give_back(); }

 private:
  void give_back() noexcept {
    for (std::size_t i = 0; i < taken_; ++i) (members_[i]->*flag_).give_back();
  }

  std::span<EmaBase* const> members_;
  BusyFlag EmaBase::*flag_;
  std::size_t taken_ = 0;
};

EMAKIT_FUNC GroupCore::GroupCore(std::vector<EmaBase*> members) : members_(std::move(members)) {
  for (std::size_t i = 0; i < members_.size(); ++i) {
    if (members_[i] == nullptr) fail("update_together: member {} is a null pointer; give every member an Ema", i);
    const EmaBase& m = *members_[i];
    m.ensure_bound("update_together");
    for (std::size_t j = 0; j < i; ++j)
      if (members_[j] == members_[i])
        fail("update_together: the same Ema is given twice (members {} and {}); each EMA updates once per step", j, i);
    if (i > 0 && !members_[0]->same_model(m)) {
      const std::string shared = members_[0]->shared_tensor(m);
      fail("update_together: member {} is bound to another model than member 0 ({}); update_together reads one "
           "model once for the EMAs of that model: update each model's EMAs apart",
           i,
           shared.empty() ? std::string("they hold no model tensor in common")
                          : fmt::format("another module, though they read some of the same tensors, e.g. '{}' (one "
                                        "module part of the other, or parameters shared between them)",
                                        shared));
    }
    if (m.options_.switch_every() > 0)
      fail("update_together: member {} writes the model after its update (EmaOptions::switch_model), which the "
           "other members would read in the same step; update it on its own, after the others",
           i);
  }
  prepared_.reserve(members_.size());
  work_.reserve(members_.size());
}

EMAKIT_FUNC void GroupCore::update(const StepInfo& info, std::span<UpdateResult> out) {
  if (out.size() != members_.size())
    fail("internal: update_together given {} results for {} members", out.size(), members_.size());
  if (members_.empty()) return;
  // What may have changed since the group was made: a member moved from, its model destroyed, a
  // swap opened.
  for (std::size_t i = 0; i < members_.size(); ++i) {
    const EmaBase& m = *members_[i];
    m.ensure_bound("update_together");
    m.check_model_alive("update_together");
    m.check_model_not_swapped("update_together", i);
  }
  const BusyAll busy(members_, &EmaBase::busy_, "update_together");
  prepared_.clear();  // capacity kept: no allocation after the first call
  work_.clear();
  for (EmaBase* m : members_) prepared_.push_back(m->prepare(info));
  for (std::size_t i = 0; i < members_.size(); ++i)
    if (members_[i]->applies(prepared_[i])) work_.push_back({&members_[i]->kernel_, prepared_[i].job});
  UpdateKernel::run_together(work_, scratch_);
  for (std::size_t i = 0; i < members_.size(); ++i) out[i] = members_[i]->finish(prepared_[i]);
}

}  // namespace detail

// ---- EmaBase -------------------------------------------------------------------------------

EMAKIT_FUNC EmaBase::EmaBase(EmaOptions options)
    : options_(std::move(options)), swap_(std::make_shared<detail::SwapState>()) {}

EMAKIT_FUNC EmaBase::~EmaBase() = default;

EMAKIT_FUNC void EmaBase::fail_moved_from(const char* what) {
  detail::fail("{}() on a moved-from Ema; use the Ema it was moved into", what);
}

EMAKIT_FUNC EmaBase::Prepared EmaBase::prepare(const StepInfo& info) {
  check_model_not_swapped("update");
  check_step_in(info);
  const detail::ema_state::Counters& c = counters_;
  const ScheduleInput in{c.calls + 1, info.step, c.step, c.num_updates, info.vetoed};
  const Decision decision = decide(in);
  check_decision(decision, info);
  return prepare_decided(Prepared{{decision.action, decision.step, std::nan(""), {}}, {}, info.vetoed});
}

EMAKIT_FUNC EmaBase::Prepared EmaBase::prepare_decided(Prepared p) {
  const detail::ema_state::Counters& c = counters_;
  const Action action = p.result.action;
  const std::int64_t step = p.result.step;
  if (action != Action::skipped) kernel_.check_sources_and_replan();  // re-plans if a source moved
  if (action != Action::skipped && options_.skip_non_finite()) {
    const std::size_t bad = kernel_.first_non_finite(action == Action::copied ? detail::UpdateKernel::Kind::copy
                                                                              : detail::UpdateKernel::Kind::average);
    if (bad != detail::UpdateKernel::npos) {
      p.result.non_finite = kernel_.name(bad);
      return p;
    }
  }
  if (action == Action::copied) {
    p.result.decay = 0.0;
  } else if (action == Action::averaged) {
    const DecayInput d_in{step, c.num_updates + 1, step - c.last_update_step};
    detail::Weights& w = p.job.weights;
    p.job.kind = detail::UpdateKernel::Kind::average;
    w = weights(d_in);
    const auto unit = [](double v) { return v >= 0.0 && v <= 1.0; };
    if (!unit(w.weight) || !unit(w.decay))
      detail::fail("decay policy {} gave d = {} at step {} (update {}); d must be in [0, 1]", policy_config().decay,
                   w.decay, d_in.step, d_in.update);
    p.result.decay = w.decay;  // d as the policy gave it (not 1 - w: that is not d in every bit)
    if (options_.drift_every() > 0 && (c.num_updates + 1) % options_.drift_every() == 0)
      p.job.drift = detail::UpdateKernel::DriftMeasure::measure;
  }
  return p;
}

EMAKIT_FUNC Drift EmaBase::drift_of_kernel(std::int64_t step) const {
  // A distance relative to a norm of 0: 0 if the distance is 0 too, else infinity.
  const auto relative = [](double d2, double x2) {
    if (x2 > 0.0) return std::sqrt(d2 / x2);
    return d2 == 0.0 ? 0.0 : (std::isnan(d2) ? d2 : std::numeric_limits<double>::infinity());
  };
  const std::span<const double> sums = kernel_.drift_sums();
  const auto& slots = kernel_.slots();
  Drift out;
  out.step = step;
  double d2 = 0.0, x2 = 0.0;
  std::size_t far = detail::UpdateKernel::npos;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (!slots[i].averaged) continue;
    d2 += sums[2 * i];
    x2 += sums[2 * i + 1];
    const double r = relative(sums[2 * i], sums[2 * i + 1]);
    // The first largest; a NaN is the farthest of all (the first one).
    const bool nan_before = far != detail::UpdateKernel::npos && std::isnan(out.farthest_relative);
    if (far == detail::UpdateKernel::npos || (!nan_before && (std::isnan(r) || r > out.farthest_relative))) {
      far = i;
      out.farthest_relative = r;
    }
  }
  out.relative = relative(d2, x2);
  if (far != detail::UpdateKernel::npos) out.farthest = slots[far].name;
  return out;
}

EMAKIT_FUNC UpdateResult EmaBase::finish(const Prepared& p) {
  detail::ema_state::Counters& c = counters_;
  UpdateResult result = p.result;
  if (p.job.measures_drift() && applies(p)) {
    result.drift = drift_of_kernel(result.step);
    last_drift_ = result.drift;
  }
  if (!result.non_finite.empty()) {
    TORCH_WARN("emakit: update at step ", result.step, " skipped: '", result.non_finite,
               "' holds a NaN or an infinity (EmaOptions::skip_non_finite); the average is unchanged");
    if (!p.off_schedule) {
      c.calls += 1;
      c.step = result.step;
    }
    c.non_finite_updates += 1;
    last_non_finite_ = result.non_finite;
    result.action = Action::skipped;
    return result;
  }
  if (options_.switch_every() > 0 && result.action != Action::copied && !p.vetoed && !p.off_schedule &&
      (result.step - options_.switch_offset()) % options_.switch_every() == 0)
    switch_model(options_.switch_beta());
  // Counters change only after the kernel succeeded: a failed update leaves the EMA as it was.
  if (!p.off_schedule) {
    c.calls += 1;
    c.step = result.step;
  }
  if (result.action != Action::skipped) {
    c.num_updates += 1;
    c.last_update_step = result.step;
    c.last_decay = result.decay;
  }
  return result;
}

EMAKIT_FUNC UpdateResult EmaBase::epoch_end(std::int64_t epoch) {
  ensure_bound("epoch_end");
  check_model_alive("epoch_end");
  detail::check_non_negative_int(epoch, "epoch_end(epoch)");
  detail::BusyScope busy(busy_, "epoch_end");
  check_model_not_swapped("epoch_end");
  const auto from = options_.epoch_end_updates_from();
  const detail::ema_state::Counters& c = counters_;
  if (!from || epoch < *from || epoch <= last_epoch_end_) return UpdateResult{Action::skipped, c.step};
  Prepared p{{c.num_updates == 0 ? Action::copied : Action::averaged, c.step, std::nan(""), {}}, {}, false};
  p.off_schedule = true;
  p = prepare_decided(std::move(p));
  if (applies(p)) kernel_.run(p.job);
  UpdateResult out = finish(p);
  last_epoch_end_ = epoch;
  return out;
}

EMAKIT_FUNC UpdateResult EmaBase::update(const StepInfo& info) {
  ensure_bound("update");
  check_model_alive("update");
  detail::BusyScope busy(busy_, "update");
  const Prepared p = prepare(info);
  if (applies(p)) kernel_.run(p.job);
  return finish(p);
}

EMAKIT_FUNC bool EmaBase::same_model(const EmaBase& other) const {
  if (model_.watched() && other.model_.watched()) return model_.same_model(other.model_);
  // EMAs of one model list its tensors in the same order: the first position decides at once.
  for (std::size_t k = 0; k < std::min(sources_.size(), other.sources_.size()); ++k)
    if (sources_[k].is_same(other.sources_[k])) return true;
  return !shared_tensor(other).empty();
}

EMAKIT_FUNC std::string EmaBase::shared_tensor(const EmaBase& other) const {
  std::unordered_set<const void*> mine;
  for (const auto& a : sources_) mine.insert(a.unsafeGetTensorImpl());
  for (const auto& e : other.entries_)
    if (mine.contains(other.sources_[e.slot].unsafeGetTensorImpl())) return e.name;
  return {};
}

EMAKIT_FUNC void EmaBase::wait_for_model_reads() const {
  ensure_bound("wait_for_model_reads");
  kernel_.wait_for_model_reads();
}

EMAKIT_FUNC void EmaBase::wait_for_update() const {
  ensure_bound("wait_for_update");
  kernel_.wait_for_update();
}

EMAKIT_FUNC StateDict EmaBase::averages() const {
  ensure_bound("averages");
  const auto& slots = kernel_.settled_slots();
  StateDict out;
  for (const auto& e : entries_) out.insert(e.name, slots[e.slot].average);
  return out;
}

EMAKIT_FUNC const at::Tensor& EmaBase::average(const std::string& name) const {
  ensure_bound("average");
  const auto& slots = kernel_.settled_slots();
  for (const auto& e : entries_)
    if (e.name == name) return slots[e.slot].average;
  detail::fail("the EMA has no tensor '{}' (ignored, or not in the model)", name);
}

EMAKIT_FUNC std::vector<std::string> EmaBase::names(Role role) const {
  std::vector<std::string> out;
  const auto& slots = kernel_.settled_slots();
  for (const auto& e : entries_) {
    const auto& s = slots[e.slot];
    const Role r = s.averaged ? Role::average : s.follows_averages ? Role::copy : Role::ignore_except_copies;
    if (r == role) out.push_back(e.name);
  }
  return out;
}

EMAKIT_FUNC void EmaBase::switch_model(double beta) {
  ensure_bound("switch_model");
  detail::check_unit_interval(beta, "switch_model beta");
  check_model_alive("switch_model");
  check_model_not_swapped("switch_model");
  c10::NoGradGuard no_grad;
  for (const auto& s : kernel_.settled_slots()) {
    if (beta == 0.0) {
      s.source.copy_(s.average);
    } else if (s.averaged) {
      s.source.lerp_(s.average.to(s.source.options()), 1.0 - beta);
    } else if (s.follows_averages) {
      s.source.copy_(s.average);
    }
  }
}

EMAKIT_FUNC SwapGuard EmaBase::swap_into() {
  ensure_bound("swap_into");
  check_model_alive("swap_into");
  if (swap_->guards > 0) return SwapGuard(swap_);
  const auto& slots = kernel_.settled_slots();
  kernel_.check_sources_and_replan();
  check_model_unchanged("swap_into");
  if (detail::swap_registry().holder(sources_, swap_.get()) != nullptr)
    detail::fail("swap_into(): the model holds another Ema's weights (a SwapGuard of another Ema bound to this "
                 "model is open); end that guard's scope first");
  std::vector<at::Tensor> targets, values;
  for (const auto& s : slots) {
    targets.push_back(s.source);
    values.push_back(s.average);
  }
  return open_swap_over(std::move(targets), values);
}

EMAKIT_FUNC SwapGuard EmaBase::swap_gathered(const StateDict& full, torch::nn::Module& model) const {
  ensure_bound("swap_gathered_into");
  std::vector<std::pair<std::string, at::Tensor>> ours;
  for (const auto& item : full) ours.emplace_back(item.key(), item.value());
  const auto match = detail::match_by_name(ours, detail::tensors_by_name(model));
  detail::require_model_match(match, "swap_gathered_into: ");
  std::vector<at::Tensor> targets;
  for (const auto& p : match.pairs) targets.push_back(p.theirs);
  if (swap_->guards > 0 || detail::swap_registry().holder(targets, nullptr) != nullptr)
    detail::fail("swap_gathered_into: the model already holds an EMA's weights (a SwapGuard is open); end that "
                 "guard's scope first");
  std::vector<at::Tensor> values;
  for (const auto& p : match.pairs) values.push_back(p.ours);
  return open_swap_over(std::move(targets), values);
}

EMAKIT_FUNC StateDict EmaBase::state_dict() const {
  ensure_bound("state_dict");
  StateDict out = detail::ema_state::encode(policy_config(), options_, counters_);
  const auto& slots = kernel_.settled_slots();
  for (const auto& e : entries_) out.insert(detail::ema_state::average_key(e.name), slots[e.slot].average);
  return out;
}

EMAKIT_FUNC LoadReport EmaBase::load_state_dict(const StateDict& state, LoadMode mode) {
  ensure_bound("load_state_dict");
  detail::ema_state::Plan plan = plan_load(state, mode);
  if (mode == LoadMode::lenient) {
    for (const auto& k : plan.report.missing)
      TORCH_WARN("emakit: load_state_dict: missing key '", k, "', kept the current value");
    for (const auto& k : plan.report.unexpected)
      TORCH_WARN("emakit: load_state_dict: unexpected key '", k, "', ignored");
    for (const auto& k : plan.report.mismatched) TORCH_WARN("emakit: load_state_dict: ", k, "; kept the current value");
  }
  {
    c10::NoGradGuard no_grad;
    const auto& slots = kernel_.settled_slots();
    for (const auto& [i, t] : plan.loads) slots[i].average.copy_(*t);
  }
  counters_ = plan.counters;
  return plan.report;
}

EMAKIT_FUNC LoadReport EmaBase::check_state_dict(const StateDict& state, LoadMode mode) const {
  ensure_bound("check_state_dict");
  return plan_load(state, mode).report;
}

EMAKIT_FUNC void EmaBase::advance(std::int64_t calls, std::int64_t step) {
  ensure_bound("advance");
  if (counters_.calls != 0 || counters_.num_updates != 0)
    detail::fail("advance() on an EMA that has already seen {} update() calls; it is only for a new EMA",
                 counters_.calls);
  detail::check_non_negative_int(calls, "advance() calls");
  detail::check_non_negative_int(step, "advance() step");
  counters_.calls = calls;
  counters_.step = step;
}

EMAKIT_FUNC void EmaBase::save(torch::serialize::OutputArchive& archive) const {
  detail::ema_state::save_archive(archive, state_dict());
}

EMAKIT_FUNC LoadReport EmaBase::load(torch::serialize::InputArchive& archive, LoadMode mode) {
  return detail::ema_state::load_archive(archive, [&](const StateDict& state) { return load_state_dict(state, mode); });
}

EMAKIT_FUNC SwapGuard EmaBase::open_swap_over(std::vector<at::Tensor> targets,
                                              const std::vector<at::Tensor>& values) const {
  c10::NoGradGuard no_grad;
  swap_->backup.clear();
  for (const auto& t : targets) swap_->backup.push_back(t.detach().clone());
  swap_->targets = std::move(targets);
  SwapGuard guard = detail::open_swap(swap_);
  for (std::size_t i = 0; i < values.size(); ++i) swap_->targets[i].copy_(values[i]);
  return guard;
}

EMAKIT_FUNC detail::ema_state::Plan EmaBase::plan_load(const StateDict& state, LoadMode mode) const {
  std::vector<at::Tensor> averages;
  for (const auto& slot : kernel_.slots()) averages.push_back(slot.average);
  return detail::ema_state::plan_load(
      state, mode, policy_config(), options_, entries_, averages,
      [](const at::Tensor& a, const at::Tensor& b) { return detail::same_view(a, b) || detail::bitwise_equal(a, b); });
}

// What bind() holds, before the storage makes it: one spec per held tensor (at the position of
// its first name), the role of each, whether it is a buffer under any of its names (a forward
// pass may write it), and every held name with its spec.
struct EmaBase::BindPlan {
  std::vector<TensorSpec> specs;
  std::vector<Role> roles;
  std::vector<char> buffer;
  std::vector<std::pair<std::string, std::size_t>> entries;  // name -> spec
};

EMAKIT_FUNC void EmaBase::bind(const torch::nn::Module* model, std::vector<SourceTensor> tensors,
                               std::string_view storage_name) {
  if (model != nullptr) model_ = detail::ModelWatch(*model);
  BindPlan plan = plan_bind(tensors);
  std::vector<at::Tensor> own;
  {
    const detail::GeneratorStates generators;  // the storage's clone or factory draws nothing the user sees
    own = create_averages(model, std::span<const TensorSpec>(plan.specs));
  }
  if (own.size() != plan.specs.size())
    detail::fail("storage {} made {} tensors for {} specs", storage_name, own.size(), plan.specs.size());
  detail::check_owned(tensors, plan.specs, own, storage_name);
  hold(std::move(plan), std::move(own));
}

EMAKIT_FUNC std::vector<Role> EmaBase::roles_of(const std::vector<SourceTensor>& tensors) {
  std::vector<std::string> all_names;
  all_names.reserve(tensors.size());
  std::unordered_set<std::string> seen;
  for (const auto& t : tensors) {
    if (!t.tensor.defined()) detail::fail("tensor '{}' is undefined; bind an Ema to defined tensors", t.name);
    if (!seen.insert(t.name).second) detail::fail("tensor name '{}' appears twice", t.name);
    all_names.push_back(t.name);
  }
  options_.check_names(all_names);
  if (const auto dev = options_.device(); dev && dev->is_cuda() && !at::globalContext().hasCUDA())
    detail::fail("EmaOptions::device is {}, but this LibTorch has no CUDA support or sees no CUDA device; use "
                 "a CPU device or leave device() unset (the model's device)",
                 dev->str());

  std::vector<Role> roles(tensors.size());
  frozen_.clear();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto dtype = tensors[i].tensor.scalar_type();
    const bool floating = c10::isFloatingType(dtype) || c10::isComplexType(dtype);
    const bool frozen = !tensors[i].is_buffer && !tensors[i].tensor.requires_grad();
    roles[i] = options_.role(tensors[i].name, tensors[i].is_buffer, floating, frozen);
    if (frozen && options_.frozen_parameters() != TensorMode::average &&
        roles[i] != options_.role(tensors[i].name, false, floating, false))
      frozen_.push_back(tensors[i].name);
  }
  return roles;
}

EMAKIT_FUNC EmaBase::BindPlan EmaBase::plan_bind(const std::vector<SourceTensor>& tensors) {
  const std::vector<Role> roles = roles_of(tensors);
  const std::size_t n = tensors.size();
  const std::vector<std::size_t> first = detail::identity_groups(tensors, roles);
  std::vector<std::vector<std::size_t>> members(n);  // by first index: every name of that tensor
  for (std::size_t i = 0; i < n; ++i) members[first[i]].push_back(i);
  std::vector<Role> group(n, Role::ignore);
  for (std::size_t g = 0; g < n; ++g)
    if (first[g] == g) group[g] = detail::group_role(tensors, roles, members[g]);

  BindPlan plan;
  std::vector<std::size_t> spec_of(n, static_cast<std::size_t>(-1));
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t g = first[i];
    const Role role = group[g];
    if (role == Role::ignore || roles[i] != role) continue;  // ignored, or an ignored name of a held tensor
    if (spec_of[g] == static_cast<std::size_t>(-1)) {
      const at::Tensor& t = tensors[i].tensor;
      detail::check_dense(tensors[i].name, t);
      const auto device = options_.device().value_or(t.device());
      const auto dtype = role == Role::average ? options_.average_dtype(t.scalar_type()) : t.scalar_type();
      spec_of[g] = plan.specs.size();
      plan.specs.push_back({tensors[i].name, t, dtype, device, {}});
      plan.roles.push_back(role);
      plan.buffer.push_back(tensors[i].is_buffer ? 1 : 0);
    } else {
      plan.specs[spec_of[g]].aliases.push_back(tensors[i].name);
      plan.buffer[spec_of[g]] |= tensors[i].is_buffer ? 1 : 0;
    }
    plan.entries.emplace_back(tensors[i].name, spec_of[g]);
  }
  if (n > 0 && plan.specs.empty())
    detail::fail("every tensor of the model is ignored (EmaOptions ignore / ignore_prefixes / buffers); the EMA "
                 "would hold nothing");
  return plan;
}

EMAKIT_FUNC void EmaBase::hold(BindPlan plan, std::vector<at::Tensor> own) {
  std::vector<detail::Slot> slots;
  std::vector<std::size_t> slot_of(plan.specs.size(), static_cast<std::size_t>(-1));
  slots.reserve(plan.specs.size());
  for (std::size_t i = 0; i < plan.specs.size(); ++i) {
    if (!own[i].defined()) continue;  // held elsewhere (ShardedStorage: by another rank)
    detail::Slot slot;
    slot.name = plan.specs[i].name;
    slot.average = own[i];
    slot.source = plan.specs[i].source;
    slot.averaged = plan.roles[i] == Role::average;
    slot.follows_averages = plan.roles[i] != Role::ignore_except_copies;
    slot.buffer = plan.buffer[i] != 0;
    slot_of[i] = slots.size();
    slots.push_back(std::move(slot));
  }
  entries_.clear();
  for (auto& [name, spec] : plan.entries)
    if (slot_of[spec] != static_cast<std::size_t>(-1)) entries_.push_back({std::move(name), slot_of[spec]});
  sources_.clear();
  for (const auto& slot : slots) sources_.push_back(slot.source);
  kernel_ = detail::UpdateKernel(std::move(slots), detail::UpdateKernel::CpuPath::fused,
                                 options_.side_stream() ? detail::SideStream::on : detail::SideStream::off,
                                 options_.staging_bytes(), options_.arithmetic());
  bound_ = true;
}

EMAKIT_FUNC void EmaBase::check_model_not_swapped(const char* what, std::size_t member) const {
  const auto call = [&] {
    return member == no_member ? fmt::format("{}()", what) : fmt::format("{}: member {}: an update", what, member);
  };
  if (swap_->guards > 0)
    detail::fail("{} while a SwapGuard holds the EMA weights in the model would average the EMA with itself; "
                 "end the guard's scope (or call restore()) first",
                 call());
  if (detail::swap_registry().holder(sources_, swap_.get()) != nullptr)
    detail::fail("{} while the model holds another Ema's weights (a SwapGuard of another Ema bound to this "
                 "model is open) would average that EMA's weights; end that guard's scope first",
                 call());
}

EMAKIT_FUNC void EmaBase::check_step_in(const StepInfo& info) const {
  constexpr auto max = std::numeric_limits<std::int64_t>::max();
  if (counters_.calls == max)
    detail::fail("update(): the call counter is at its maximum ({}); it cannot count another call", max);
  if (info.step) {
    if (*info.step < 0) detail::fail("update({{.step = {}}}): a step must be >= 0", *info.step);
  } else if (counters_.step == max) {
    detail::fail("update(): the step counter is at its maximum ({}); it cannot count another step", max);
  }
}

EMAKIT_FUNC void EmaBase::check_decision(const Decision& d, const StepInfo& info) const {
  auto source = [&] {
    return info.step ? fmt::format("update({{.step = {}}})", *info.step)
                     : fmt::format("update() (schedule {})", policy_config().schedule);
  };
  if (d.step < 0) detail::fail("{}: a step must be >= 0, got {}", source(), d.step);
  if (d.step < counters_.step)
    detail::fail("{}: the step went backwards, to {} (the last step was {})", source(), d.step, counters_.step);
  if (d.action != Action::skipped && counters_.num_updates > 0 && d.step <= counters_.last_update_step)
    detail::fail("{}: step {} was already applied (the last update was at step {}); an update at a step must "
                 "come once",
                 source(), d.step, counters_.last_update_step);
}

EMAKIT_FUNC void EmaBase::transfer(const torch::nn::Module& model, Direction direction) const {
  const bool into_model = direction == Direction::into_model;
  ensure_bound(into_model ? "copy_to" : "copy_from");
  const auto& slots = kernel_.settled_slots();
  std::vector<std::pair<std::string, at::Tensor>> ours;
  for (const auto& e : entries_) ours.emplace_back(e.name, slots[e.slot].average);
  const auto match = detail::match_by_name(ours, detail::tensors_by_name(model));
  detail::require_model_match(match);  // no problem: match.pairs[i] is entries_[i]
  std::vector<std::pair<const detail::Slot*, at::Tensor>> pairs;
  std::vector<bool> seen(slots.size(), false);
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const std::size_t slot = entries_[i].slot;
    if (into_model || !seen[slot]) pairs.emplace_back(&slots[slot], match.pairs[i].theirs);
    seen[slot] = true;
  }
  c10::NoGradGuard no_grad;
  for (auto& [s, t] : pairs) {
    if (into_model)
      t.copy_(s->average);
    else
      s->average.copy_(t);
  }
}

EMAKIT_FUNC void EmaBase::check_model_unchanged(const char* what) const {
  const auto model = model_.lock();
  if (!model) return;  // bound to tensors, or a module not owned by a shared_ptr (destroyed: check_model_alive)
  const auto theirs = detail::tensors_by_name(*model);
  const auto& slots = kernel_.slots();
  for (const auto& e : entries_) {
    auto it = theirs.find(e.name);
    if (it == theirs.end())
      detail::fail("{}(): the model no longer has tensor '{}' that the EMA was bound to (was a sub-module "
                   "replaced?); make a new Ema for the changed model",
                   what, e.name);
    if (it->second.unsafeGetTensorImpl() != slots[e.slot].source.unsafeGetTensorImpl())
      detail::fail("{}(): the model's tensor '{}' is not the one the EMA was bound to (a sub-module replaced with "
                   "replace_module(), or the parameter registered anew, after the Ema was made); the EMA weights "
                   "would not reach the model. Make a new Ema for the changed model",
                   what, e.name);
  }
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
