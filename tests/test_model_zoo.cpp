// The model zoo (issue 14): generated LibTorch module trees, run through every storage, decay and
// schedule policy and compared, after every update, with a plain reference written here from the
// documented semantics (docs in schedule.hpp, decay.hpp, options.hpp and DESIGN.md).
//
// Each case is made from one seed: a module tree (nested sub-modules, a sub-module registered
// under two names, tied tensors, frozen parameters, float/complex/integer/bool tensors, transposed,
// strided and zero-size tensors), a storage, a decay, a schedule, EmaOptions and a sequence of
// update() calls (vetoed ones, caller-supplied steps) with seeded noise added to the model between
// them. A few cases (about 8%) are made to be refused: a sparse tensor the options do not leave
// out (every storage), a module that registers a tensor given to it from outside the tree
// (ModuleStorage: its copy would hold the model's own tensor), a buffer and a transposed view of it
// both held (two views of overlapping memory), or options that leave every tensor out. The Ema
// must then throw std::invalid_argument naming (in quotes) one of the tensors concerned, and leave
// the model as it was.
//
// The reference keeps one average per unique tensor (same data pointer, sizes, strides and dtype),
// whatever names it has. Comparisons:
//   - bitwise: every floating average, real or complex. The reference computes ATen's lerp formula,
//     a + w*(x-a) for |w| < 0.5 else x + (w-1)*(x-a), one rounding per operation in float (fp32,
//     fp16, bf16 averages) or double (double averages), on the source rounded to the average's
//     dtype: the operation order the EMA documents, so the bits must agree. Also every copy
//     (integer and bool buffers, copy_only names, copied buffers) and the state-dict round trip.
//     A complex average goes through ATen's complex lerp, whose weight is w + 0i: the products
//     with the zero part are exact zeros, fused or not, so each component rounds as the
//     component-wise formula the reference computes on the real view.
//   - within 2^-54: UpdateResult::decay and Ema::decay() against the formula's d. The EMA reports
//     1 - w with w = 1 - d: for d >= 1/2 both subtractions are exact (Sterbenz), for d < 1/2
//     1 - d rounds once in [1/2, 1] (half an ulp there: 2^-54) and 1 - w is exact. The weight
//     w = 1 - d the reference averages with is the formula's own, so the averages stay bitwise.
//
//   EMAKIT_ZOO_CASES=100000 ./emakit_tests "[zoo]"   a long run (default: kDefaultCases)
//   EMAKIT_ZOO_SEED=123 ./emakit_tests "[zoo]"       one case again, with its model's tensor table
#include <emakit/ema.hpp>

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace test_model_zoo {  // this file's names (unity batches: tests/CMakeLists.txt)

namespace {

using emakit::Action;
using emakit::TensorMode;
using emakit::Warmup;
using emakit::WindowEdge;

constexpr std::uint64_t kDefaultCases = 300;

// ---- seeded choices ----------------------------------------------------------------------------

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : engine_(seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull) {}
  int below(std::size_t n) { return static_cast<int>(engine_() % static_cast<std::uint64_t>(n)); }
  double unit() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return unit() < p; }
  double symmetric() { return 2.0 * unit() - 1.0; }
  template <class T>
  T pick(std::initializer_list<T> options) {
    return *(options.begin() + below(options.size()));
  }
  template <class T>
  const T& pick(const std::vector<T>& options) {
    return options[static_cast<std::size_t>(below(options.size()))];
  }

 private:
  std::mt19937_64 engine_;
};

// ---- the generated module trees ----------------------------------------------------------------

enum class Layout : std::uint8_t { contiguous, transposed, strided, zero_size, large, sparse };

struct TensorPlan {
  std::string name;  // in its module
  bool buffer = false;
  c10::ScalarType dtype = at::kFloat;
  std::vector<std::int64_t> shape;  // sizes as the module registers it
  Layout layout = Layout::contiguous;
  bool frozen = false;  // a parameter with requires_grad false
};

struct TiePlan {
  std::string alias;   // the second name, in this module
  std::string target;  // a tensor of this module or below ("m0.m1.p2")
  bool buffer = false;
};

struct NodePlan {
  std::vector<TensorPlan> tensors;
  std::vector<std::pair<std::string, std::string>> views;  // (name, base buffer): base.t(), another view
  std::vector<std::pair<std::string, std::shared_ptr<NodePlan>>> children;
  std::vector<std::pair<std::string, std::string>> shared;  // (second name, child): one module, two names
  std::vector<TiePlan> ties;                                // one tensor, two names
  bool external = false;  // registers "ext", a tensor made outside the tree and given to it
};

at::Tensor make_tensor(const TensorPlan& p) {
  const auto options = at::TensorOptions().dtype(p.dtype);
  switch (p.layout) {
    case Layout::transposed:  // register_parameter("w", torch::randn({4, 3}).t())
      return at::zeros({p.shape[1], p.shape[0]}, options).t();
    case Layout::strided: {  // every second element, from element 1
      const std::int64_t n = p.shape[0];
      return at::zeros({2 * n + 1}, options).slice(0, 1, 2 * n + 1, 2);
    }
    case Layout::sparse: {
      const at::Tensor indices = at::tensor(std::vector<std::int64_t>{0, 1, 3, 2, 0, 4}).view({2, 3});
      return at::sparse_coo_tensor(indices, at::ones({3}, options), {4, 5});
    }
    default: return at::zeros(p.shape, options);
  }
}

// One module type for every node of every tree. Cloneable (reset() rebuilds the node from its
// plan), so ModuleStorage can clone it; ModuleStorage's factory form builds a new tree from the plan.
struct ZooImpl : torch::nn::Cloneable<ZooImpl> {
  ZooImpl(std::shared_ptr<const NodePlan> plan, at::Tensor external)
      : plan_(std::move(plan)), external_(std::move(external)) {
    reset();
  }

  void reset() override {
    for (const auto& t : plan_->tensors) {
      if (t.buffer)
        register_buffer(t.name, make_tensor(t));
      else
        register_parameter(t.name, make_tensor(t), /*requires_grad=*/!t.frozen);
    }
    for (const auto& [name, base] : plan_->views) {
      const auto own = named_buffers(/*recurse=*/false);
      register_buffer(name, own[base].t());
    }
    std::map<std::string, std::shared_ptr<ZooImpl>> made;
    for (const auto& [name, child] : plan_->children)
      made[name] = register_module(name, std::make_shared<ZooImpl>(child, external_));
    for (const auto& [second, first] : plan_->shared) register_module(second, made.at(first));
    for (const auto& tie : plan_->ties) {
      if (tie.buffer) {
        const auto all = named_buffers(/*recurse=*/true);
        register_buffer(tie.alias, all[tie.target]);
      } else {
        const auto all = named_parameters(/*recurse=*/true);
        const at::Tensor target = all[tie.target];
        register_parameter(tie.alias, target, target.requires_grad());
      }
    }
    if (plan_->external) register_parameter("ext", external_, /*requires_grad=*/true);
  }

  std::shared_ptr<const NodePlan> plan_;
  at::Tensor external_;
};

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// Parameters then buffers, as the Ema and the state dict list them.
Named named_tensors(const torch::nn::Module& m) {
  Named out;
  for (const auto& item : m.named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  for (const auto& item : m.named_buffers(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  return out;
}

std::set<std::string> buffer_names(const torch::nn::Module& m) {
  std::set<std::string> out;
  for (const auto& item : m.named_buffers(/*recurse=*/true)) out.insert(item.key());
  return out;
}

// A tensor's identity: same memory seen the same way (data pointer, sizes, strides, dtype). An
// empty or sparse tensor has no memory to compare: its TensorImpl is its identity.
struct Identity {
  const void* address = nullptr;
  bool by_impl = false;
  std::vector<std::int64_t> sizes, strides;
  c10::ScalarType dtype = at::kFloat;
  bool operator==(const Identity&) const = default;
};

Identity identity_of(const at::Tensor& t) {
  Identity id;
  id.dtype = t.scalar_type();
  id.sizes.assign(t.sizes().begin(), t.sizes().end());
  if (t.is_sparse() || t.numel() == 0) {
    id.address = t.unsafeGetTensorImpl();
    id.by_impl = true;
    return id;
  }
  id.address = t.data_ptr();
  id.strides.assign(t.strides().begin(), t.strides().end());
  return id;
}

// Index of each tensor's identity among the unique ones, in listing order.
std::vector<std::size_t> identity_groups(const Named& tensors, std::size_t* unique = nullptr) {
  std::vector<Identity> seen;
  std::vector<std::size_t> out;
  for (const auto& [name, t] : tensors) {
    const Identity id = identity_of(t);
    auto it = std::find(seen.begin(), seen.end(), id);
    if (it == seen.end()) {
      seen.push_back(id);
      out.push_back(seen.size() - 1);
    } else {
      out.push_back(static_cast<std::size_t>(it - seen.begin()));
    }
  }
  if (unique != nullptr) *unique = seen.size();
  return out;
}

bool is_float_or_complex(c10::ScalarType t) { return c10::isFloatingType(t) || c10::isComplexType(t); }

// Writes seeded values into t (add = false) or adds seeded noise to it (add = true, an optimizer
// step); bool tensors get new random values either way.
void randomize(const at::Tensor& t, Rng& rng, bool add) {
  if (t.is_sparse() || t.numel() == 0) return;
  at::NoGradGuard no_grad;
  const auto type = t.scalar_type();
  const double scale = add ? 0.25 : 1.0;
  at::Tensor v;
  if (c10::isComplexType(type)) {
    v = at::empty(t.sizes(), at::kComplexDouble);
    auto* p = v.data_ptr<c10::complex<double>>();
    for (std::int64_t i = 0; i < v.numel(); ++i) p[i] = {scale * rng.symmetric(), scale * rng.symmetric()};
  } else if (c10::isFloatingType(type)) {
    v = at::empty(t.sizes(), at::kDouble);
    auto* p = v.data_ptr<double>();
    for (std::int64_t i = 0; i < v.numel(); ++i) p[i] = scale * rng.symmetric();
  } else if (type == at::kBool) {
    v = at::empty(t.sizes(), at::kBool);
    auto* p = v.data_ptr<bool>();
    for (std::int64_t i = 0; i < v.numel(); ++i) p[i] = rng.chance(0.5);
    t.copy_(v);
    return;
  } else {
    v = at::empty(t.sizes(), at::kLong);
    auto* p = v.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < v.numel(); ++i) p[i] = add ? rng.below(5) : rng.below(200);
  }
  if (add)
    t.add_(v.to(type));
  else
    t.copy_(v);
}

// ---- the policies of a case, as plain values -------------------------------------------------

enum class StorageKind : std::uint8_t { flat, module_factory, module_clone };
enum class DecayKind : std::uint8_t { fixed, ramp, warmup, power, uniform };
enum class DtypeChoice : std::uint8_t { model_default, f64, f32, keep_model, bf16, f16 };

struct DecayPlan {
  DecayKind kind = DecayKind::fixed;
  double beta = 0.9999;  // Fixed, InversePowerWarmup
  double ramp = 0.9999, tau = 2000;
  double inv_gamma = 1, power = 2.0 / 3.0, min_value = 0;
  std::int64_t after = 0;
  bool warmup = true, single = false;
  double gamma = 6.9372039376;
};

struct SchedulePlan {
  std::int64_t start = 0;
  Warmup warmup = Warmup::none;
  std::int64_t every = 1, offset = 0, accumulate = 1;
  WindowEdge edge = WindowEdge::end;

  emakit::StepSchedule make() const {
    return emakit::StepSchedule()
        .start_step(start)
        .warmup(warmup)
        .update_every(every)
        .every_offset(offset)
        .accumulate(accumulate)
        .window_edge(edge);
  }
};

struct OptionsPlan {
  TensorMode buffers = TensorMode::average;
  std::string ignore, copy_only;
  DtypeChoice dtype = DtypeChoice::model_default;

  emakit::EmaOptions make() const {
    emakit::EmaOptions o;
    o.buffers(buffers);
    if (!ignore.empty()) o.ignore({ignore});
    if (!copy_only.empty()) o.copy_only({copy_only});
    switch (dtype) {
      case DtypeChoice::f64: o.dtype(at::kDouble); break;
      case DtypeChoice::f32: o.dtype(at::kFloat); break;
      case DtypeChoice::bf16: o.dtype(at::kBFloat16); break;
      case DtypeChoice::f16: o.dtype(at::kHalf); break;
      case DtypeChoice::keep_model: o.keep_model_dtype(true); break;
      default: break;
    }
    return o;
  }
};

enum class Role : std::uint8_t { average, copy, ignore };

// options.hpp: ignored names and (with TensorMode::ignore) buffers are left out; integer and bool
// tensors are copied; copy_only names and (TensorMode::copy) buffers are copied; the rest averaged.
Role role_of(const OptionsPlan& o, const std::string& name, bool buffer, c10::ScalarType type) {
  if (name == o.ignore) return Role::ignore;
  if (buffer && o.buffers == TensorMode::ignore) return Role::ignore;
  if (!is_float_or_complex(type)) return Role::copy;
  if (name == o.copy_only || (buffer && o.buffers == TensorMode::copy)) return Role::copy;
  return Role::average;
}

// The dtype of an average: complex stays complex; else the dtype option, or the model's with
// keep_model_dtype; by default fp32 for bf16/fp16 tensors and the model's own otherwise.
c10::ScalarType average_dtype(const OptionsPlan& o, c10::ScalarType source) {
  if (c10::isComplexType(source)) return source;
  switch (o.dtype) {
    case DtypeChoice::f64: return at::kDouble;
    case DtypeChoice::f32: return at::kFloat;
    case DtypeChoice::bf16: return at::kBFloat16;
    case DtypeChoice::f16: return at::kHalf;
    case DtypeChoice::keep_model: return source;
    default: return source == at::kHalf || source == at::kBFloat16 ? at::kFloat : source;
  }
}

// A model the Ema must refuse with std::invalid_argument whose message names (in quotes) one of
// `names` (any message when `names` is empty), leaving the model as it was.
struct Refusal {
  bool expected = false;
  std::vector<std::string> names;
  std::string why;
};

struct Case {
  std::uint64_t seed = 0;
  std::shared_ptr<const NodePlan> root;
  at::Tensor external;  // given to the tree from outside (defined when a module registers it)
  std::shared_ptr<ZooImpl> model;
  StorageKind storage = StorageKind::flat;
  DecayPlan decay;
  SchedulePlan schedule;
  OptionsPlan options;
  bool explicit_steps = false;
  double veto_rate = 0;
  int calls = 0;
  std::string layout;  // one line
  Refusal refusal;

  std::shared_ptr<ZooImpl> build_tree() const { return std::make_shared<ZooImpl>(root, external); }
};

const char* dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "f32";
    case at::kDouble: return "f64";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    case at::kComplexFloat: return "c64";
    case at::kLong: return "i64";
    case at::kInt: return "i32";
    case at::kByte: return "u8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

std::string describe(const Case& c) {
  std::string storage = c.storage == StorageKind::flat             ? "FlatStorage"
                        : c.storage == StorageKind::module_factory ? "ModuleStorage<ZooImpl>(factory)"
                                                                   : "ModuleStorage<ZooImpl>(Cloneable)";
  const auto& d = c.decay;
  std::string decay;
  switch (d.kind) {
    case DecayKind::fixed: decay = fmt::format("Fixed({})", d.beta); break;
    case DecayKind::ramp: decay = fmt::format("ExponentialRamp({}, tau {})", d.ramp, d.tau); break;
    case DecayKind::warmup:
      decay = fmt::format("InversePowerWarmup(beta {}, inv_gamma {}, power {:.4f}, min {}, after {}{}{})", d.beta,
                          d.inv_gamma, d.power, d.min_value, d.after, d.warmup ? "" : ", no warmup",
                          d.single ? ", single precision" : "");
      break;
    case DecayKind::power: decay = fmt::format("PowerFunction(gamma {})", d.gamma); break;
    case DecayKind::uniform: decay = "Uniform"; break;
  }
  const auto& s = c.schedule;
  const char* warm = s.warmup == Warmup::none                ? "none"
                     : s.warmup == Warmup::copy_before_start ? "copy_before_start"
                                                             : "skip_before_start";
  const char* buffers = c.options.buffers == TensorMode::average ? "average"
                        : c.options.buffers == TensorMode::copy  ? "copy"
                                                                 : "ignore";
  static const char* const dtypes[] = {"default", "f64", "f32", "keep_model_dtype", "bf16", "f16"};
  return fmt::format(
      "seed {}: {} | {} | {} | StepSchedule(start {} {}, every {} offset {}, accumulate {} at {}) | {} calls, {} "
      "steps, veto {} | buffers {}, ignore '{}', copy_only '{}', dtype {}{}",
      c.seed, c.layout, storage, decay, s.start, warm, s.every, s.offset, s.accumulate,
      s.edge == WindowEdge::end ? "end" : "start", c.calls, c.explicit_steps ? "explicit" : "counted", c.veto_rate,
      buffers, c.options.ignore, c.options.copy_only, dtypes[static_cast<int>(c.options.dtype)],
      c.refusal.expected ? fmt::format(" | must refuse: {}", c.refusal.why) : std::string());
}

// ---- generating a case ------------------------------------------------------------------------

struct Budget {
  int tensors = 0;
  bool large = false;
};

TensorPlan plan_tensor(Rng& rng, const std::string& name, bool buffer, Budget& budget) {
  TensorPlan t;
  t.name = name;
  t.buffer = buffer;
  if (buffer) {
    t.dtype = rng.pick<c10::ScalarType>({at::kFloat, at::kFloat, at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                         at::kComplexFloat, at::kLong, at::kLong, at::kInt, at::kByte, at::kBool});
  } else {
    t.dtype = rng.pick<c10::ScalarType>({at::kFloat, at::kFloat, at::kFloat, at::kFloat, at::kHalf, at::kBFloat16,
                                         at::kBFloat16, at::kDouble, at::kComplexFloat});
    t.frozen = rng.chance(0.2);
  }
  const double u = rng.unit();
  if (u < 0.07) {
    t.layout = Layout::zero_size;
    t.shape = rng.chance(0.5) ? std::vector<std::int64_t>{0} : std::vector<std::int64_t>{1 + rng.below(3), 0};
  } else if (u < 0.20) {
    t.layout = Layout::transposed;
    t.shape = {1 + rng.below(5), 2 + rng.below(4)};
  } else if (u < 0.28) {
    t.layout = Layout::strided;
    t.shape = {1 + rng.below(9)};
  } else if (u < 0.30 && !budget.large && !buffer) {
    budget.large = true;  // large enough for the update to be split between threads inside it
    t.layout = Layout::large;
    t.shape = {70001};
  } else {
    const int dims = rng.below(4);  // 0-dim scalars too
    for (int i = 0; i < dims; ++i) t.shape.push_back(1 + rng.below(5));
  }
  ++budget.tensors;
  return t;
}

std::shared_ptr<NodePlan> plan_node(Rng& rng, int depth_left, Budget& budget, bool root) {
  auto node = std::make_shared<NodePlan>();
  const int n = budget.tensors > 40 ? 0 : (root ? 1 : 0) + rng.below(4);
  for (int i = 0; i < n; ++i) {
    const bool buffer = rng.chance(0.35);
    node->tensors.push_back(plan_tensor(rng, fmt::format("{}{}", buffer ? "b" : "p", i), buffer, budget));
  }
  const int children = depth_left <= 0 ? 0 : (root ? 1 : 0) + rng.below(3);
  for (int i = 0; i < children; ++i)
    node->children.emplace_back(fmt::format("m{}", i), plan_node(rng, depth_left - 1, budget, false));
  if (!node->children.empty() && rng.chance(0.25)) node->shared.emplace_back("again", rng.pick(node->children).first);

  // Ties: a tensor of a descendant registered here again (an output head tied to an embedding),
  // or a tensor of this module registered under a second name.
  std::vector<std::pair<std::string, const TensorPlan*>> candidates;
  std::function<void(const NodePlan&, const std::string&)> collect = [&](const NodePlan& p, const std::string& at) {
    for (const auto& t : p.tensors) candidates.emplace_back(at + t.name, &t);
    for (const auto& [name, child] : p.children) collect(*child, at + name + ".");
  };
  collect(*node, "");
  const int ties = rng.chance(0.35) ? 1 + rng.below(2) : 0;
  for (int i = 0; i < ties && !candidates.empty(); ++i) {
    const auto& [path, t] = rng.pick(candidates);
    node->ties.push_back({fmt::format("tie{}", i), path, t->buffer});
  }
  return node;
}

// Every node of a plan (to place a sparse or external tensor in one).
void all_nodes(NodePlan& p, std::vector<NodePlan*>& out) {
  out.push_back(&p);
  for (auto& [name, child] : p.children) all_nodes(*child, out);
}

int plan_depth(const NodePlan& p) {
  int d = 0;
  for (const auto& [name, child] : p.children) d = std::max(d, plan_depth(*child));
  return d + 1;
}

std::string layout_line(const Case& c) {
  const Named tensors = named_tensors(*c.model);
  std::size_t unique = 0;
  identity_groups(tensors, &unique);
  std::map<std::string, int> dtypes;
  int noncontiguous = 0, empty = 0, frozen = 0, large = 0;
  const auto buffers = buffer_names(*c.model);
  for (const auto& [name, t] : tensors) {
    ++dtypes[dtype_name(t.scalar_type())];
    if (t.is_sparse()) continue;
    noncontiguous += t.is_contiguous() ? 0 : 1;
    empty += t.numel() == 0 ? 1 : 0;
    large += t.numel() > 10000 ? 1 : 0;
    frozen += !buffers.count(name) && !t.requires_grad() ? 1 : 0;
  }
  int shared = 0, ties = 0, views = 0;
  std::function<void(const NodePlan&)> count = [&](const NodePlan& p) {
    shared += static_cast<int>(p.shared.size());
    ties += static_cast<int>(p.ties.size());
    views += static_cast<int>(p.views.size());
    for (const auto& [name, child] : p.children) count(*child);
  };
  count(*c.root);
  std::string types;
  for (const auto& [k, v] : dtypes) types += fmt::format("{}{}:{}", types.empty() ? "" : " ", k, v);
  return fmt::format(
      "depth {}, {} names / {} tensors, {} tied, {} shared submodule, {} views, {} non-contiguous, {} zero-size, "
      "{} frozen, {} large, dtypes [{}]",
      plan_depth(*c.root), tensors.size(), unique, ties, shared, views, noncontiguous, empty, frozen, large, types);
}

Case generate(std::uint64_t seed) {
  Rng rng(seed);
  Case c;
  c.seed = seed;
  Budget budget;
  auto root = plan_node(rng, 1 + rng.below(4), budget, /*root=*/true);

  // Placed in one random module each: a float buffer and a transposed view of it (two tensors, one
  // memory); a sparse tensor (refused unless left out); a tensor made outside the tree and given to
  // it (refused by ModuleStorage: its copy of the module would hold the model's own tensor).
  std::vector<NodePlan*> nodes;
  all_nodes(*root, nodes);
  if (rng.chance(0.12)) {
    NodePlan* node = rng.pick(nodes);
    TensorPlan base;
    base.name = "vb";
    base.buffer = true;
    base.dtype = rng.pick<c10::ScalarType>({at::kFloat, at::kDouble, at::kBFloat16});
    base.shape = {2 + rng.below(3), 2 + rng.below(3)};
    node->tensors.push_back(base);
    node->views.emplace_back("vb_t", "vb");
  }
  const double u = rng.unit();
  if (u < 0.025) {
    TensorPlan sp;
    sp.name = "sp";
    sp.buffer = rng.chance(0.5);
    sp.layout = Layout::sparse;
    rng.pick(nodes)->tensors.push_back(sp);
  } else if (u < 0.065) {
    rng.pick(nodes)->external = true;
    c.external = at::zeros({3, 2});
  }
  c.root = root;
  c.model = c.build_tree();

  const Named tensors = named_tensors(*c.model);
  const auto groups = identity_groups(tensors);
  {  // seeded values, one draw per unique tensor
    std::vector<bool> done(tensors.size(), false);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (done[groups[i]]) continue;
      done[groups[i]] = true;
      randomize(tensors[i].second, rng, /*add=*/false);
    }
  }
  auto is_special = [&](const at::Tensor& t) {
    return t.is_sparse() || (c.external.defined() && t.is_same(c.external));
  };

  const double s = rng.unit();
  c.storage = s < 0.4 ? StorageKind::flat : s < 0.75 ? StorageKind::module_factory : StorageKind::module_clone;

  auto& d = c.decay;
  d.kind = static_cast<DecayKind>(rng.below(5));
  switch (d.kind) {
    case DecayKind::fixed: d.beta = rng.pick({0.0, 0.5, 0.6, 0.9, 0.99, 0.999, 0.9999}); break;
    case DecayKind::ramp:
      d.ramp = rng.pick({0.9, 0.99, 0.9999});
      d.tau = rng.pick({0.5, 2.0, 10.0, 2000.0});
      break;
    case DecayKind::warmup:
      d.beta = rng.pick({0.9, 0.99, 0.9999});
      d.inv_gamma = rng.pick({1.0, 0.5, 4.0});
      d.power = rng.pick({2.0 / 3.0, 0.75, 1.0});
      d.min_value = rng.chance(0.3) ? 0.05 : 0.0;
      d.after = rng.pick<std::int64_t>({0, 1, 2, 4, 7});
      d.warmup = !rng.chance(0.15);
      d.single = rng.chance(0.15);
      break;
    case DecayKind::power: d.gamma = rng.pick({0.2, 1.8262137799, 3.5578687749, 6.9372039376, 16.9721986023}); break;
    case DecayKind::uniform: break;
  }

  auto& sc = c.schedule;
  sc.start = rng.pick<std::int64_t>({0, 0, 1, 2, 3, 5});
  sc.warmup = static_cast<Warmup>(rng.below(3));
  sc.every = rng.pick<std::int64_t>({1, 1, 2, 3});
  sc.offset = rng.pick<std::int64_t>({0, 0, 1, 2});
  sc.accumulate = rng.pick<std::int64_t>({1, 1, 1, 2, 3});
  sc.edge = rng.chance(0.5) ? WindowEdge::end : WindowEdge::start;
  c.explicit_steps = rng.chance(0.25);
  c.veto_rate = rng.pick({0.0, 0.0, 0.15, 0.3});
  c.calls = 4 + rng.below(8) + static_cast<int>(sc.accumulate) * 2;

  // Options. ignore / copy_only name tensors that have one name only: which role a tensor with two
  // names takes when one of them is named is not what this test is about.
  auto& o = c.options;
  o.buffers = rng.pick({TensorMode::average, TensorMode::average, TensorMode::copy, TensorMode::ignore});
  const double dt = rng.unit();
  o.dtype = dt < 0.5    ? DtypeChoice::model_default
            : dt < 0.72 ? DtypeChoice::f64
            : dt < 0.82 ? DtypeChoice::f32
            : dt < 0.92 ? DtypeChoice::keep_model
            : dt < 0.96 ? DtypeChoice::bf16
                        : DtypeChoice::f16;
  const auto buffers = buffer_names(*c.model);
  std::vector<std::size_t> multiplicity(tensors.size(), 0);
  for (auto g : groups) ++multiplicity[g];
  std::vector<std::string> single, views;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (multiplicity[groups[i]] != 1 || is_special(tensors[i].second)) continue;
    single.push_back(tensors[i].first);
    const auto& n = tensors[i].first;
    if (n == "vb" || n == "vb_t" || n.ends_with(".vb") || n.ends_with(".vb_t")) views.push_back(n);
  }
  if (!views.empty() && rng.chance(0.6))  // one view left out: the other is averaged
    o.ignore = rng.pick(views);
  else if (!single.empty() && rng.chance(0.3))
    o.ignore = rng.pick(single);
  std::vector<std::string> copyable;
  for (const auto& n : single)
    if (n != o.ignore && !(o.buffers == TensorMode::ignore && buffers.count(n))) copyable.push_back(n);
  if (!copyable.empty() && rng.chance(0.3)) o.copy_only = rng.pick(copyable);

  c.layout = layout_line(c);

  // What the Ema must refuse, from the roles the options give each tensor.
  const auto buffer_set = buffers;
  std::vector<bool> held(tensors.size(), false);
  std::vector<std::vector<std::string>> names_of(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    names_of[groups[i]].push_back(name);
    if (role_of(o, name, buffer_set.count(name) > 0, t.scalar_type()) != Role::ignore) held[groups[i]] = true;
  }
  auto refuse = [&](std::size_t group, const std::string& why) {
    c.refusal.expected = true;
    for (const auto& n : names_of[group]) c.refusal.names.push_back(n);
    if (!why.empty()) c.refusal.why += (c.refusal.why.empty() ? "" : "; ") + why;
  };
  // The first name of each held tensor.
  std::vector<bool> first_held(tensors.size(), false);
  {
    std::vector<bool> seen(tensors.size(), false);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      first_held[i] = !seen[groups[i]] && held[groups[i]];
      seen[groups[i]] = true;
    }
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!first_held[i]) continue;
    const at::Tensor& t = tensors[i].second;
    if (t.is_sparse()) refuse(groups[i], fmt::format("'{}' is sparse", tensors[i].first));
    if (c.storage != StorageKind::flat && c.external.defined() && t.is_same(c.external))
      refuse(groups[i], fmt::format("'{}' was given to its module from outside", tensors[i].first));
    // Two held tensors that are different views of overlapping memory (the library refuses them:
    // each would be written back over the other).
    for (std::size_t j = 0; j < i; ++j) {
      if (!first_held[j]) continue;
      const at::Tensor& other = tensors[j].second;
      if (t.is_sparse() || other.is_sparse() || t.numel() == 0 || other.numel() == 0) continue;
      if (t.storage().unsafeGetStorageImpl() != other.storage().unsafeGetStorageImpl()) continue;
      auto extent = [](const at::Tensor& x) {
        std::int64_t last = x.storage_offset();
        for (std::int64_t d = 0; d < x.dim(); ++d) last += (x.size(d) - 1) * x.stride(d);
        return std::make_pair(x.storage_offset() * x.element_size(), (last + 1) * x.element_size());
      };
      const auto [a0, a1] = extent(t);
      const auto [b0, b1] = extent(other);
      if (a0 < b1 && b0 < a1) {
        refuse(groups[i], fmt::format("'{}' and '{}' are different views of overlapping memory", tensors[j].first,
                                      tensors[i].first));
        refuse(groups[j], "");
      }
    }
  }
  if (!tensors.empty() && std::none_of(held.begin(), held.end(), [](bool h) { return h; })) {
    c.refusal.expected = true;
    c.refusal.why += (c.refusal.why.empty() ? "" : "; ") + std::string("every tensor is left out");
  }
  return c;
}

// The model's tensors as a table (printed when one seed is rerun).
std::string tensor_table(const Case& c) {
  const Named tensors = named_tensors(*c.model);
  const auto groups = identity_groups(tensors);
  const auto buffers = buffer_names(*c.model);
  std::string out;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    out +=
        fmt::format("\n  {:<22} tensor #{:<3} {:<6} {:<4} sizes [{}] {}{}{}", name, groups[i],
                    buffers.count(name) ? "buffer" : "param", dtype_name(t.scalar_type()), fmt::join(t.sizes(), ", "),
                    t.is_sparse()       ? "sparse"
                    : t.is_contiguous() ? ""
                                        : "non-contiguous",
                    !buffers.count(name) && !t.requires_grad() ? " frozen" : "",
                    c.external.defined() && t.is_same(c.external) ? " external" : "");
  }
  return out;
}

// ---- the reference ------------------------------------------------------------------------------

// d and the lerp weight w = 1 - d (Uniform: w = 1/n itself) of an averaging update, from the
// formulas of decay.hpp / DESIGN.md.
std::pair<double, double> reference_decay(const DecayPlan& p, std::int64_t step, std::int64_t update,
                                          std::int64_t since) {
  double d = 0;
  switch (p.kind) {
    case DecayKind::fixed: d = p.beta; break;
    case DecayKind::ramp: d = p.ramp * (1.0 - std::exp(-static_cast<double>(update) / p.tau)); break;
    case DecayKind::warmup: {
      auto formula = [&](auto one) -> double {
        using T = decltype(one);
        const T e = static_cast<T>(step - p.after - 1);
        if (e <= T(0)) return 0.0;
        if (!p.warmup) return p.beta;
        const T v = T(1) - std::pow(T(1) + e / static_cast<T>(p.inv_gamma), static_cast<T>(-p.power));
        return static_cast<double>(std::clamp(v, static_cast<T>(p.min_value), static_cast<T>(p.beta)));
      };
      d = p.single ? formula(1.0f) : formula(1.0);
      break;
    }
    case DecayKind::power: {
      const auto t = static_cast<double>(step), dt = static_cast<double>(since);
      d = t <= dt ? 0.0 : std::pow(1.0 - dt / t, p.gamma + 1.0);
      break;
    }
    case DecayKind::uniform: {
      const double w = update <= 1 ? 1.0 : 1.0 / static_cast<double>(update);
      return {1.0 - w, w};
    }
  }
  return {d, 1.0 - d};
}

// avg = lerp(avg, x, w) in ATen's formula, one rounding per operation, in float (or double for a
// double average); x already in avg's dtype. avg is real and contiguous.
void reference_lerp(at::Tensor& avg, const at::Tensor& x_same_dtype, double w) {
  const auto op = avg.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor a = avg.to(op);
  const at::Tensor x = x_same_dtype.to(op);
  const double wt = op == at::kDouble ? w : static_cast<double>(static_cast<float>(w));
  const at::Tensor diff = x - a;
  const at::Tensor r = std::abs(wt) < 0.5 ? a + diff * wt : x + diff * (wt - 1.0);
  avg.copy_(r);
}

struct Expected {
  Action action = Action::skipped;
  std::int64_t step = 0;
  double decay = std::nan("");
};

class Reference {
 public:
  struct Average {
    at::Tensor source;  // the model's tensor
    at::Tensor value;   // the reference's own, contiguous
    bool averaged = false;
  };

  Reference(const torch::nn::Module& model, const Case& c) : plan_(c) {
    const Named tensors = named_tensors(model);
    const auto buffers = buffer_names(model);
    const auto groups = identity_groups(tensors);
    std::map<std::size_t, std::pair<std::size_t, bool>> slot_of_group;  // group -> (slot, averaged)
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto& [name, t] = tensors[i];
      const auto role = role_of(c.options, name, buffers.count(name) > 0, t.scalar_type());
      if (role == Role::ignore) continue;
      const bool averaged = role == Role::average;
      auto it = slot_of_group.find(groups[i]);
      if (it == slot_of_group.end()) {
        Average a;
        a.source = t;
        a.averaged = averaged;
        a.value = at::empty(t.sizes(), at::TensorOptions().dtype(averaged ? average_dtype(c.options, t.scalar_type())
                                                                          : t.scalar_type()));
        a.value.copy_(t.detach());
        slots_.push_back(std::move(a));
        it = slot_of_group.emplace(groups[i], std::make_pair(slots_.size() - 1, averaged)).first;
      } else if (it->second.second != averaged) {
        throw std::logic_error("zoo generator: one tensor with two names in two roles: " + name);
      }
      names_.emplace_back(name, it->second.first);
    }
  }

  // The names the EMA must report, in the model's order, and the average each shows.
  const std::vector<std::pair<std::string, std::size_t>>& names() const { return names_; }
  const Average& slot(std::size_t i) const { return slots_[i]; }

  std::int64_t calls = 0, step = 0, num_updates = 0, last_update_step = 0;
  double last_decay = std::nan("");

  Expected update(std::optional<std::int64_t> given, bool vetoed) {
    calls += 1;
    const auto& s = plan_.schedule;
    // One optimizer step per window of `accumulate` calls, completed at its end (or start); a
    // vetoed call completes none; a step the caller gives is taken as it is.
    const bool at_edge =
        s.accumulate == 1 || (s.edge == WindowEdge::end ? calls % s.accumulate == 0 : (calls - 1) % s.accumulate == 0);
    const bool completes = at_edge && !vetoed;
    Expected e;
    e.step = given ? *given : step + (completes ? 1 : 0);
    step = e.step;
    if (!completes) return e;
    const bool eligible = (e.step - s.offset) % s.every == 0;
    const bool started = e.step >= s.start;
    switch (s.warmup) {
      case Warmup::none: e.action = started && eligible ? Action::averaged : Action::skipped; break;
      case Warmup::copy_before_start:
        e.action = num_updates == 0 ? Action::copied
                   : !eligible      ? Action::skipped
                   : started        ? Action::averaged
                                    : Action::copied;
        break;
      case Warmup::skip_before_start:
        e.action = !started || !eligible ? Action::skipped : num_updates == 0 ? Action::copied : Action::averaged;
        break;
    }
    at::NoGradGuard no_grad;
    if (e.action == Action::copied) {
      for (auto& a : slots_) a.value.copy_(a.source.detach());
      e.decay = 0.0;
    } else if (e.action == Action::averaged) {
      const auto [d, w] = reference_decay(plan_.decay, e.step, num_updates + 1, e.step - last_update_step);
      for (auto& a : slots_) {
        if (!a.averaged) {
          a.value.copy_(a.source.detach());
        } else if (a.value.is_complex()) {
          at::Tensor real = at::view_as_real(a.value);
          reference_lerp(real, at::view_as_real(a.source.detach().to(a.value.scalar_type()).contiguous()), w);
        } else {
          reference_lerp(a.value, a.source.detach().to(a.value.scalar_type()), w);
        }
      }
      e.decay = d;
    }
    if (e.action != Action::skipped) {
      num_updates += 1;
      last_update_step = e.step;
      last_decay = e.decay;
    }
    return e;
  }

 private:
  const Case& plan_;
  std::vector<Average> slots_;
  std::vector<std::pair<std::string, std::size_t>> names_;
};

// ---- checks (each returns what is wrong, or an empty string) -----------------------------------

std::string element_string(const at::Tensor& flat, std::int64_t i) {
  if (flat.is_complex()) {
    const auto v = flat[i].item<c10::complex<double>>();
    return fmt::format("({:.9g}, {:.9g})", v.real(), v.imag());
  }
  return fmt::format("{:.9g}", flat[i].item<double>());
}

// Elements of averaged tensors compared after an averaging update, real and complex: the test
// asserts that the zoo reached both (a comparison of nothing proves nothing).
struct Compared {
  std::int64_t real = 0, complex = 0;
};
Compared compared;

// got and want hold the same bytes (see the top of this file for why every comparison is bitwise).
std::string compare(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  if (!got.defined()) return fmt::format("{}: undefined", what);
  if (got.scalar_type() != want.scalar_type())
    return fmt::format("{}: dtype {}, the reference has {}", what, dtype_name(got.scalar_type()),
                       dtype_name(want.scalar_type()));
  if (!got.sizes().equals(want.sizes()))
    return fmt::format("{}: sizes [{}], the reference has [{}]", what, fmt::join(got.sizes(), ", "),
                       fmt::join(want.sizes(), ", "));
  if (got.numel() == 0) return {};
  const at::Tensor g = got.detach().contiguous(), w = want.detach().contiguous();
  if (std::memcmp(g.data_ptr(), w.data_ptr(), g.nbytes()) == 0) return {};
  const at::Tensor gf = g.reshape({-1}), wf = w.reshape({-1});
  const at::Tensor differs =
      (gf.view(at::kByte).view({gf.numel(), -1}) != wf.view(at::kByte).view({wf.numel(), -1})).any(1);
  const std::int64_t count = differs.sum().item<std::int64_t>();
  const std::int64_t first = count > 0 ? differs.nonzero()[0][0].item<std::int64_t>() : 0;
  return fmt::format("{}: {} of {} elements differ bitwise; first at flat index {}: {} vs reference {}", what, count,
                     gf.numel(), first, element_string(gf, first), element_string(wf, first));
}

bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_sparse() || b.is_sparse()) return a.is_same(b);
  return a.is_alias_of(b) || a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

// DESIGN.md, Identity and ownership: no tensor of the EMA shares memory with the model.
std::string check_ownership(const Named& ema_tensors, const Named& model_tensors, const char* whose) {
  for (const auto& [name, a] : ema_tensors)
    for (const auto& [model_name, m] : model_tensors)
      if (shares_memory(a, m))
        return fmt::format("{} '{}' shares memory with the model's '{}'", whose, name, model_name);
  return {};
}

struct ModelSnapshot {
  struct Item {
    std::string name;
    at::Tensor handle;
    const void* address = nullptr;
    std::vector<std::int64_t> sizes, strides;
    bool requires_grad = false;
    at::Tensor values;
  };
  std::vector<Item> items;
};

ModelSnapshot snapshot(const torch::nn::Module& model) {
  ModelSnapshot s;
  for (const auto& [name, t] : named_tensors(model)) {
    ModelSnapshot::Item item;
    item.name = name;
    item.handle = t;
    item.sizes.assign(t.sizes().begin(), t.sizes().end());
    item.requires_grad = t.requires_grad();
    if (t.is_sparse()) {
      item.values = t.detach().to_dense();
    } else {
      item.address = t.data_ptr();
      item.strides.assign(t.strides().begin(), t.strides().end());
      item.values = t.detach().clone();
    }
    s.items.push_back(std::move(item));
  }
  return s;
}

// DESIGN.md: binding an EMA never changes the model (not its data, not its requires_grad).
std::string check_unchanged(const torch::nn::Module& model, const ModelSnapshot& before, const char* after) {
  const Named now = named_tensors(model);
  if (now.size() != before.items.size())
    return fmt::format("after {}: the model lists {} tensors, {} before", after, now.size(), before.items.size());
  for (std::size_t i = 0; i < now.size(); ++i) {
    const auto& b = before.items[i];
    const auto& [name, t] = now[i];
    if (name != b.name) return fmt::format("after {}: the model's tensor {} is '{}', was '{}'", after, i, name, b.name);
    if (!t.is_same(b.handle)) return fmt::format("after {}: the model's '{}' is another tensor", after, name);
    if (t.requires_grad() != b.requires_grad)
      return fmt::format("after {}: the model's '{}' has requires_grad {}, was {}", after, name, t.requires_grad(),
                         b.requires_grad);
    if (!t.is_sparse()) {
      if (t.data_ptr() != b.address)
        return fmt::format("after {}: the model's '{}' has new memory (data_ptr {} -> {})", after, name, b.address,
                           t.data_ptr());
      if (!t.strides().equals(b.strides)) return fmt::format("after {}: the model's '{}' has new strides", after, name);
    }
    const at::Tensor values = t.is_sparse() ? t.detach().to_dense() : t.detach();
    if (auto err = compare(fmt::format("after {}: the model's '{}'", after, name), values, b.values); !err.empty())
      return err;
  }
  return {};
}

std::string action_name(Action a) {
  return a == Action::skipped ? "skipped" : a == Action::copied ? "copied" : "averaged";
}

// got == want up to the one rounding of 1 - d (2^-54: see the comment at the top).
bool same_decay(double got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return std::abs(got - want) <= std::ldexp(1.0, -54);
}

// ---- one case ---------------------------------------------------------------------------------

template <class Storage>
constexpr bool is_module_storage = !std::is_same_v<Storage, emakit::FlatStorage>;

// The EMA's averages (and, for ModuleStorage, its module's tensors) against the reference.
template <class EmaT>
std::string check_averages(const EmaT& ema, const Reference& ref, const std::string& when) {
  const auto averages = ema.averages();
  std::vector<std::string> got, want;
  for (const auto& item : averages) got.push_back(item.key());
  for (const auto& [name, slot] : ref.names()) want.push_back(name);
  if (got != want)
    return fmt::format("{}: the EMA holds [{}], the reference [{}]", when, fmt::join(got, ", "), fmt::join(want, ", "));
  std::map<std::string, at::Tensor> module_tensors;
  if constexpr (is_module_storage<typename EmaT::storage_type>)
    for (auto& [name, t] : named_tensors(*ema.module())) module_tensors.emplace(name, t);
  std::size_t i = 0;
  for (const auto& item : averages) {
    const auto& [name, slot] = ref.names()[i++];
    const auto& a = ref.slot(slot);
    if (auto err = compare(fmt::format("{}: averages()['{}']", when, name), item.value(), a.value); !err.empty())
      return err;
    if (a.averaged && ema.num_updates() > 1)
      (a.value.is_complex() ? compared.complex : compared.real) += a.value.numel();
    if (auto err = compare(fmt::format("{}: average('{}')", when, name), ema.average(name), a.value); !err.empty())
      return err;
    if constexpr (is_module_storage<typename EmaT::storage_type>) {
      auto it = module_tensors.find(name);
      if (it == module_tensors.end()) return fmt::format("{}: the EMA module has no tensor '{}'", when, name);
      if (auto err = compare(fmt::format("{}: the EMA module's '{}'", when, name), it->second, a.value); !err.empty())
        return err;
    }
  }
  return {};
}

template <class EmaT>
std::string check_counters(const EmaT& ema, const Reference& ref, const std::string& when) {
  if (ema.calls() != ref.calls || ema.step() != ref.step || ema.num_updates() != ref.num_updates ||
      ema.last_update_step() != ref.last_update_step || !same_decay(ema.decay(), ref.last_decay))
    return fmt::format("{}: counters calls/step/num_updates/last_update_step/decay are {}/{}/{}/{}/{}, the reference "
                       "{}/{}/{}/{}/{}",
                       when, ema.calls(), ema.step(), ema.num_updates(), ema.last_update_step(), ema.decay(), ref.calls,
                       ref.step, ref.num_updates, ref.last_update_step, ref.last_decay);
  return {};
}

template <class EmaT>
std::string check_ema_ownership(const EmaT& ema, const torch::nn::Module& model) {
  const Named model_tensors = named_tensors(model);
  Named averages;
  for (const auto& item : ema.averages()) averages.emplace_back(item.key(), item.value());
  if (auto err = check_ownership(averages, model_tensors, "average"); !err.empty()) return err;
  if constexpr (is_module_storage<typename EmaT::storage_type>) {
    const auto& module = ema.module();
    if (!module) return "ModuleStorage: module() is null";
    if (auto err = check_ownership(named_tensors(*module), model_tensors, "the EMA module's tensor"); !err.empty())
      return err;
    if (module->is_training()) return "ModuleStorage: the EMA module is in training mode, not eval()";
    for (const auto& item : module->named_parameters(/*recurse=*/true))
      if (item.value().requires_grad())
        return fmt::format("ModuleStorage: the EMA module's parameter '{}' requires grad", item.key());
  }
  return {};
}

std::string first_line(const std::string& s) {
  const auto end = s.find('\n');
  return end == std::string::npos ? s : s.substr(0, end) + " [...]";
}

template <class Decay, class Storage, class MakeStorage>
std::string run_case(Case& c, const Decay& decay, MakeStorage make_storage) {
  using EmaT = emakit::Ema<Decay, emakit::StepSchedule, Storage>;
  const torch::nn::Module& model = *c.model;
  const emakit::EmaOptions options = c.options.make();
  const emakit::StepSchedule schedule = c.schedule.make();
  const ModelSnapshot before = snapshot(model);
  const Refusal& refusal = c.refusal;
  const std::string expected = refusal.names.empty()
                                   ? std::string("any message")
                                   : fmt::format("a message naming one of '{}'", fmt::join(refusal.names, "', '"));

  std::optional<EmaT> ema;
  try {
    ema.emplace(model, decay, schedule, options, make_storage());
  } catch (const std::invalid_argument& e) {
    if (!refusal.expected) return fmt::format("the Ema refused the model: {}", e.what());
    const std::string message = e.what();
    const bool named = refusal.names.empty() || std::any_of(refusal.names.begin(), refusal.names.end(), [&](auto& n) {
                         return message.find("'" + n + "'") != std::string::npos;
                       });
    if (!named)
      return fmt::format("the Ema refused the model ({}), but not with {}: {}", refusal.why, expected, message);
    return check_unchanged(model, before, "a refused binding");
  } catch (const std::exception& e) {
    if (!refusal.expected) throw;
    return fmt::format("expected std::invalid_argument ({}), got another exception: {}", refusal.why,
                       first_line(e.what()));
  }
  if (refusal.expected)
    return fmt::format("expected std::invalid_argument with {} ({}), but the Ema was made", expected, refusal.why);

  if (auto err = check_unchanged(model, before, "binding the Ema"); !err.empty()) return err;
  if (auto err = check_ema_ownership(*ema, model); !err.empty()) return "after binding: " + err;

  Reference ref(model, c);
  if (auto err = check_averages(*ema, ref, "after binding"); !err.empty()) return err;
  if (auto err = check_counters(*ema, ref, "after binding"); !err.empty()) return err;

  Rng noise(c.seed ^ 0xA5A5A5A5DEADBEEFull);
  const Named tensors = named_tensors(model);
  const auto groups = identity_groups(tensors);
  std::int64_t given = noise.below(4);
  for (int k = 1; k <= c.calls; ++k) {
    {  // an optimizer step: every unique tensor moves once, integer buffers change
      std::vector<bool> done(tensors.size(), false);
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        if (done[groups[i]]) continue;
        done[groups[i]] = true;
        randomize(tensors[i].second, noise, /*add=*/true);
      }
    }
    emakit::StepInfo info;
    info.vetoed = noise.chance(c.veto_rate);
    if (c.explicit_steps) {
      given += 1 + noise.below(3);
      info.step = given;
    }
    const emakit::UpdateResult got = ema->update(info);
    const Expected want = ref.update(info.step, info.vetoed);
    const std::string when = fmt::format("call {}{}{} (expected: {} at step {})", k, info.vetoed ? ", vetoed" : "",
                                         info.step ? fmt::format(", step {} given", *info.step) : std::string(),
                                         action_name(want.action), want.step);
    if (got.action != want.action || got.step != want.step || !same_decay(got.decay, want.decay))
      return fmt::format("{}: update() returned {} at step {} with decay {}, the reference {} at step {} with decay {}",
                         when, action_name(got.action), got.step, got.decay, action_name(want.action), want.step,
                         want.decay);
    if (auto err = check_counters(*ema, ref, when); !err.empty()) return err;
    if (auto err = check_averages(*ema, ref, when); !err.empty()) return err;
  }
  if (auto err = check_ema_ownership(*ema, model); !err.empty()) return "after the updates: " + err;

  // A state_dict() loaded into a fresh Ema of the same model reproduces every average bitwise.
  const auto state = ema->state_dict();
  const ModelSnapshot again = snapshot(model);
  EmaT fresh(model, decay, schedule, options, make_storage());
  if (auto err = check_unchanged(model, again, "binding a second Ema"); !err.empty()) return err;
  fresh.load_state_dict(state);
  const auto mine = ema->averages();
  const auto theirs = fresh.averages();
  if (mine.size() != theirs.size())
    return fmt::format("state round trip: {} averages, {} after loading", mine.size(), theirs.size());
  for (const auto& item : mine) {
    if (auto err = compare(fmt::format("state round trip: '{}'", item.key()), fresh.average(item.key()), item.value());
        !err.empty())
      return err;
    if constexpr (is_module_storage<Storage>) {
      for (auto& [name, t] : named_tensors(*fresh.module()))
        if (name == item.key())
          if (auto err = compare(fmt::format("state round trip: the EMA module's '{}'", name), t, item.value());
              !err.empty())
            return err;
    }
  }
  if (fresh.calls() != ema->calls() || fresh.step() != ema->step() || fresh.num_updates() != ema->num_updates() ||
      fresh.last_update_step() != ema->last_update_step())
    return "state round trip: the counters differ";
  return check_ema_ownership(fresh, model);
}

template <class Decay>
std::string run_with_storage(Case& c, const Decay& decay) {
  switch (c.storage) {
    case StorageKind::flat: return run_case<Decay, emakit::FlatStorage>(c, decay, [] { return emakit::FlatStorage(); });
    case StorageKind::module_factory:
      return run_case<Decay, emakit::ModuleStorage<ZooImpl>>(
          c, decay, [&c] { return emakit::ModuleStorage<ZooImpl>([&c] { return c.build_tree(); }); });
    case StorageKind::module_clone:
      return run_case<Decay, emakit::ModuleStorage<ZooImpl>>(c, decay, [] { return emakit::ModuleStorage<ZooImpl>(); });
  }
  return "unknown storage";
}

std::string run(Case& c) {
  const auto& d = c.decay;
  switch (d.kind) {
    case DecayKind::fixed: return run_with_storage(c, emakit::Fixed(d.beta));
    case DecayKind::ramp: return run_with_storage(c, emakit::ExponentialRamp(d.ramp, d.tau));
    case DecayKind::warmup:
      return run_with_storage(c, emakit::InversePowerWarmup(d.beta)
                                     .inv_gamma(d.inv_gamma)
                                     .power(d.power)
                                     .min_value(d.min_value)
                                     .update_after_step(d.after)
                                     .warmup(d.warmup)
                                     .single_precision(d.single));
    case DecayKind::power: return run_with_storage(c, emakit::PowerFunction(d.gamma));
    case DecayKind::uniform: return run_with_storage(c, emakit::Uniform());
  }
  return "unknown decay";
}

std::optional<std::uint64_t> env_number(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::strtoull(v, nullptr, 10);
}

}  // namespace

TEST_CASE("Model zoo: generated module trees match a plain reference under every storage, decay and schedule",
          "[zoo]") {
  const auto one = env_number("EMAKIT_ZOO_SEED");
  const std::uint64_t first = one.value_or(0);
  const std::uint64_t count = one ? 1 : env_number("EMAKIT_ZOO_CASES").value_or(kDefaultCases);
  constexpr std::size_t kShown = 20;  // failing cases reported in full; the rest by seed

  std::vector<std::uint64_t> failing;
  std::set<std::pair<int, int>> storage_x_decay;
  int refusals = 0;
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    Case c = generate(seed);
    const std::string description = describe(c);
    INFO("zoo case " << description << (one ? tensor_table(c) : std::string()));
    storage_x_decay.emplace(static_cast<int>(c.storage), static_cast<int>(c.decay.kind));
    refusals += c.refusal.expected ? 1 : 0;
    std::string error;
    try {
      error = run(c);
    } catch (const std::exception& e) {
      error = "unexpected exception: " + first_line(e.what());
    }
    if (error.empty()) continue;
    failing.push_back(seed);
    if (failing.size() <= kShown) FAIL_CHECK(error);  // INFO above gives the seed and the case
  }
  WARN(count << " zoo cases (seeds " << first << " to " << first + count - 1 << "), " << refusals
             << " of them built to be refused, " << failing.size() << " failed");
  if (!failing.empty())
    FAIL_CHECK(failing.size() << " of " << count << " zoo cases failed (rerun one with EMAKIT_ZOO_SEED=<seed>); seeds: "
                              << fmt::format("{}", fmt::join(failing, " ")));
  WARN(compared.real << " real and " << compared.complex << " complex averaged elements compared bitwise");
  if (count >= 100) {
    CHECK(storage_x_decay.size() == 15);  // every storage with every decay
    CHECK(refusals > 0);
    CHECK(compared.real > 0);
    CHECK(compared.complex > 0);
  }
}

}  // namespace test_model_zoo
