// emakit::update_together (together.hpp): several EMAs of one model updated in one pass must be
// exactly, bitwise, what each one's own update() gives, counters and UpdateResults included. A
// differential test over generated cases: sources of every dtype and layout the update reads
// (fp32, bf16, fp16, fp64, integers; contiguous, transposed, zero-size, large enough to be cut
// between threads and blocks), members with their own decay, schedule (start, every, offset,
// warmup mode), buffer and dtype options, vetoed steps and non-finite steps; against the same
// members updated one by one, on the same model; the drift each measures (EmaOptions::drift_every)
// bitwise too.
// And the drift the same passes measure (EmaOptions::drift_every, emakit::Drift): over generated
// tensors of every dtype pair and layout, on the fused pass and the foreach path, the sums are
// those of the averages as written, against a double reference, measuring them changes no
// average, and the same update measures the same drift, bitwise, with any number of threads.
#include <emakit/emakit.hpp>
#include <emakit/posthoc.hpp>

#include "helpers.hpp"

#include <ATen/Parallel.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/linear.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <new>
#include <span>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

// Every allocation made, on any thread, while `counting` is set: the replaceable operator new (a
// program has one: this is the test program's), or under ASan, whose operator new must stay, its
// malloc hook (which sees ATen's tensors too).
namespace test_together_allocations {
inline std::atomic<bool> counting{false};
inline std::atomic<long> made{0};
inline void note() noexcept {
  if (counting.load(std::memory_order_relaxed)) made.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace test_together_allocations

#if defined(__SANITIZE_ADDRESS__)
// Declared here: the sanitizer runtime (GCC's libasan, LLVM's compiler-rt) exports it, but only
// LLVM ships the header that declares it (sanitizer/allocator_interface.h; GCC 12 has none).
extern "C" int __sanitizer_install_malloc_and_free_hooks(void (*malloc_hook)(const volatile void*, std::size_t),
                                                         void (*free_hook)(const volatile void*));
namespace {
void count_malloc(const volatile void*, std::size_t) { test_together_allocations::note(); }
void ignore_free(const volatile void*) {}
const int malloc_hooks_installed = __sanitizer_install_malloc_and_free_hooks(count_malloc, ignore_free);
}  // namespace
#else
void* operator new(std::size_t n) {
  test_together_allocations::note();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
// g++ 12 warns at each delete it inlines that memory from operator new reaches free(): here it is
// the malloc of the operator new above (357 warnings in a build of the tests).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

namespace test_together {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;

namespace {

using Member = emakit::Ema<emakit::InversePowerWarmup>;  // decay: a warmup, or a fixed beta (warmup off)

struct Case {
  std::vector<emakit::SourceTensor> sources;
  std::vector<std::pair<emakit::InversePowerWarmup, emakit::StepSchedule>> policies;
  std::vector<emakit::EmaOptions> options;
  std::vector<bool> vetoed;     // per step
  std::vector<int> non_finite;  // per step: the source given a NaN (-1: none)
  bool all_fused = true;        // every source contiguous: each member's update is the fused CPU pass
  bool crowd = false;           // 9-11 members, each measuring its drift
  std::string text;
};

Case generate(std::uint64_t seed, int steps) {
  std::mt19937_64 rng(seed);
  const auto below = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
  const auto unit = [&] { return static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  Case c;
  const int tensors = 1 + below(6);
  for (int i = 0; i < tensors; ++i) {
    const c10::ScalarType dtype = std::vector<c10::ScalarType>{
        at::kFloat, at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kLong}[below(i == 0 ? 5 : 6)];
    // Sizes: small, zero, and one past several blocks and the parallel grain (2^15 fp32 elements).
    const std::int64_t n = std::vector<std::int64_t>{1, 7, 0, 2049, 40000, 70001}[below(6)];
    at::Tensor t =
        dtype == at::kLong ? at::randint(0, 1000, {n}, at::TensorOptions().dtype(at::kLong)) : at::randn({n}).to(dtype);
    if (n > 1 && below(5) == 0) {  // a transposed view: not contiguous, read through a staging copy
      t = at::randn({2, n}).to(dtype).t();
      c.all_fused = false;
    }
    const bool buffer = dtype == at::kLong || (i > 0 && below(3) == 0);  // t0: a parameter, which every member holds
    c.sources.push_back({"t" + std::to_string(i), t, buffer});
    c.text += fmt::format("{}{}[{}]{} ", buffer ? "buffer " : "", c10::toString(dtype), t.numel(),
                          t.is_contiguous() ? "" : " transposed");
  }
  // Now and then a crowd: more members than a group's pass ever special-cased (eight), all measuring.
  c.crowd = below(8) == 0;
  const int k = c.crowd ? 9 + below(3) : 2 + below(3);
  for (int m = 0; m < k; ++m) {
    emakit::InversePowerWarmup decay(0.5 + 0.49 * unit());
    decay.warmup(below(2) == 0).inv_gamma(1.0 + unit()).power(0.5 + 0.5 * unit());
    emakit::StepSchedule schedule;
    schedule.start_step(below(4))
        .update_every(1 + below(3))
        .every_offset(below(2))
        .warmup(static_cast<emakit::Warmup>(below(3)));
    emakit::EmaOptions options;
    options
        .buffers(std::vector<emakit::TensorMode>{emakit::TensorMode::average, emakit::TensorMode::copy,
                                                 emakit::TensorMode::ignore}[below(3)])
        .keep_model_dtype(below(3) == 0)
        .skip_non_finite(below(2) == 0)
        .drift_every(c.crowd ? 1 + below(2) : below(3))
        .arithmetic(static_cast<emakit::Arithmetic>(below(5)));
    c.text += fmt::format("| member {}: beta {:.3f} warmup {} start {} every {} offset {} mode {} buffers {} keep {} "
                          "skip_non_finite {} drift_every {} arithmetic {} ",
                          m, decay.beta(), decay.warmup(), schedule.start_step(), schedule.update_every(),
                          schedule.every_offset(), static_cast<int>(schedule.warmup()),
                          static_cast<int>(options.buffers()), options.keep_model_dtype(), options.skip_non_finite(),
                          options.drift_every(), emakit::arithmetic_name(options.arithmetic()));
    c.policies.emplace_back(decay, schedule);
    c.options.push_back(options);
  }
  for (int s = 0; s < steps; ++s) {
    c.vetoed.push_back(below(6) == 0);
    c.non_finite.push_back(below(10) == 0 ? below(tensors) : -1);
  }
  return c;
}

std::vector<Member> make_members(const Case& c) {
  std::vector<Member> out;
  for (std::size_t m = 0; m < c.policies.size(); ++m)
    out.emplace_back(c.sources, c.policies[m].first, c.policies[m].second, c.options[m]);
  return out;
}

// The next "optimizer step": every floating source moves, an integer one counts on.
void move_sources(const Case& c, int step) {
  torch::NoGradGuard no_grad;
  for (const auto& s : c.sources) {
    if (s.tensor.is_floating_point()) {
      s.tensor.add_(at::randn(s.tensor.sizes()).to(s.tensor.scalar_type()), 0.1);
    } else {
      s.tensor.add_(1);
    }
  }
  const int bad = c.non_finite[static_cast<std::size_t>(step)];
  if (bad >= 0 && c.sources[static_cast<std::size_t>(bad)].tensor.is_floating_point() &&
      c.sources[static_cast<std::size_t>(bad)].tensor.numel() > 0) {
    at::Tensor first = c.sources[static_cast<std::size_t>(bad)].tensor;
    while (first.dim() > 0) first = first.select(0, 0);  // a view of its first element, any layout
    first.fill_(std::nan(""));
  }
}

// The same dtype, shape and bytes (NaNs included: a non-finite step reaches the average when the
// member does not skip it).
bool same_bits(const at::Tensor& a, const at::Tensor& b) { return emakit::detail::bitwise_equal(a, b); }

// Every tensor and counter of `a` equals `b`'s, bitwise; returns the number of tensors compared.
std::size_t require_same(const Member& a, const Member& b) {
  REQUIRE(a.step() == b.step());
  REQUIRE(a.calls() == b.calls());
  REQUIRE(a.num_updates() == b.num_updates());
  REQUIRE(a.last_update_step() == b.last_update_step());
  REQUIRE(a.non_finite_updates() == b.non_finite_updates());
  REQUIRE(std::bit_cast<std::uint64_t>(a.decay()) == std::bit_cast<std::uint64_t>(b.decay()));
  const auto x = a.averages(), y = b.averages();
  REQUIRE(x.size() == y.size());
  std::size_t compared = 0;
  for (const auto& item : x) {
    INFO(item.key());
    REQUIRE(same_bits(item.value(), y[item.key()]));
    ++compared;
  }
  return compared;
}

// The bound of a drift sum (lerp_drift_range): a chunk of drift_chunk terms summed in float, each
// term within 3 roundings (the difference, its square, and the widening of a bf16/fp16 average
// is exact), relative to the exact sum; the chunks' and shares' sums in double add nothing that
// counts. Two measurements of one state are within twice that of each other.
constexpr double drift_roundings = static_cast<double>(emakit::detail::drift_chunk) + 3;
double drift_bound(double exact, c10::ScalarType average) {
  return drift_roundings * std::ldexp(1.0, average == at::kDouble ? -53 : -24) * std::abs(exact);
}

// Two drifts of the same averages within 2 x (drift_roundings) float roundings (the relative
// distances are square roots of a ratio of two sums: half the sums' relative error each); NaN as NaN.
bool close_drift(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::abs(a - b) <= 2 * drift_roundings * 0x1.0p-24 * std::max(std::abs(a), std::abs(b));
}

bool same_double(double a, double b) { return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b); }

// Two drifts measured of the same averages: the same bits (NaN as NaN).
bool same_drift(const std::optional<emakit::Drift>& a, const std::optional<emakit::Drift>& b) {
  const auto same = [](double x, double y) { return same_double(x, y) || (std::isnan(x) && std::isnan(y)); };
  return a.has_value() == b.has_value() &&
         (!a || (a->step == b->step && same(a->relative, b->relative) && a->farthest == b->farthest &&
                 same(a->farthest_relative, b->farthest_relative)));
}

bool same_result(const emakit::UpdateResult& a, const emakit::UpdateResult& b) {
  const bool drift = same_drift(a.drift, b.drift);
  return a.action == b.action && a.step == b.step && a.non_finite == b.non_finite &&
         std::bit_cast<std::uint64_t>(a.decay) == std::bit_cast<std::uint64_t>(b.decay) && drift;
}

}  // namespace

TEST_CASE("update_together is bitwise each member's own update(), over generated models, schedules and options",
          "[together]") {
  const char* env = std::getenv("EMAKIT_TOGETHER_CASES");  // more cases on demand
  const std::uint64_t cases = env != nullptr ? std::stoull(env) : 40;
  constexpr int kSteps = 12;
  std::size_t tensors_compared = 0, results_compared = 0, fused_cases = 0, fallback_cases = 0, drifts_compared = 0,
              crowds_fused = 0;
  for (std::uint64_t seed = 1; seed <= cases; ++seed) {
    torch::manual_seed(seed);
    Case c = generate(seed, kSteps);
    INFO("seed " << seed << ": " << c.text);
    std::vector<Member> together = make_members(c), apart = make_members(c);
    bool fused = false;
    for (int step = 0; step < kSteps; ++step) {
      INFO("step " << step + 1);
      move_sources(c, step);
      const emakit::StepInfo info{.vetoed = c.vetoed[static_cast<std::size_t>(step)]};
      const std::uint64_t fused_before = emakit::detail::testing::sync_counts().fused_calls;
      const auto results = emakit::update_together(std::span<Member>(together), info);
      fused = fused || emakit::detail::testing::sync_counts().fused_calls > fused_before;
      REQUIRE(results.size() == apart.size());
      for (std::size_t m = 0; m < apart.size(); ++m) {
        INFO("member " << m);
        const auto own = apart[m].update(info);
        REQUIRE(same_result(results[m], own));
        ++results_compared;
        drifts_compared += own.drift ? 1 : 0;
      }
      for (std::size_t m = 0; m < apart.size(); ++m) tensors_compared += require_same(together[m], apart[m]);
    }
    // With every member's update the fused pass, the members were fused whenever two of them applied.
    if (c.all_fused) {
      fused_cases += fused ? 1 : 0;
      crowds_fused += fused && c.crowd ? 1 : 0;
    } else {
      fallback_cases += 1;
    }
  }
  INFO("tensors compared " << tensors_compared << ", results " << results_compared);
  CHECK(results_compared >= cases * kSteps * 2);
  CHECK(tensors_compared > results_compared);
  CHECK(fused_cases > cases / 3);  // the fused path ran (most generated cases have every source contiguous)
  CHECK(fallback_cases > 0);       // and so did the members' own kernels (transposed sources)
  CHECK(drifts_compared > results_compared / 10);  // members measured their drift (drift_every 1 or 2)
  CHECK(crowds_fused >= 1);                        // a pass of 9-11 members measuring drift
  std::cout << "update_together: " << cases << " cases, " << results_compared << " results and " << tensors_compared
            << " tensors and " << drifts_compared << " drifts compared bitwise; " << fused_cases << " cases fused, "
            << fallback_cases << " with a member's own kernel, " << crowds_fused << " crowds of 9-11 fused"
            << std::endl;
}

TEST_CASE("update_together of different Ema types, and PostHocEma's profiles, run one fused pass", "[together]") {
  emakit_test::TinyNet model;
  emakit::Ema<emakit::Fixed> fast(*model, emakit::Fixed(0.9));
  emakit::Ema<emakit::InversePowerWarmup> warm(*model);
  emakit::Ema<emakit::Uniform> mean(*model);
  emakit::Ema<emakit::Fixed> fast2(*model, emakit::Fixed(0.9));
  emakit::Ema<emakit::InversePowerWarmup> warm2(*model);
  emakit::Ema<emakit::Uniform> mean2(*model);
  const auto groupings = emakit::detail::testing::sync_counts().fused_groupings;
  emakit::EmaGroup group(fast, warm, mean);
  for (int step = 1; step <= 5; ++step) {
    emakit_test::perturb(*model);
    const auto calls = emakit::detail::testing::sync_counts().fused_calls;
    const auto results = group.update();
    CHECK(emakit::detail::testing::sync_counts().fused_calls == calls + 1);
    CHECK(same_result(results[0], fast2.update()));
    CHECK(same_result(results[1], warm2.update()));
    CHECK(same_result(results[2], mean2.update()));
  }
  CHECK(emakit_test::same_averages(fast.averages(), emakit_test::snapshot(fast2.averages())));
  CHECK(emakit_test::same_averages(warm.averages(), emakit_test::snapshot(warm2.averages())));
  CHECK(emakit_test::same_averages(mean.averages(), emakit_test::snapshot(mean2.averages())));
  CHECK(fast.num_updates() == 5);
  // The members' segments were grouped at the group's first update only (their plans did not
  // change); the later ones took the grouping with their new weights (warm's and mean's change
  // every step).
  CHECK(emakit::detail::testing::sync_counts().fused_groupings == groupings + 1);
  // Another group groups its own members, and the first keeps its grouping.
  emakit::EmaGroup other(fast2, warm2);
  other.update();
  group.update();
  CHECK(emakit::detail::testing::sync_counts().fused_groupings == groupings + 2);
  // update_together(a, b, ...) is a group for one call: it groups anew each time.
  emakit::update_together(fast, warm, mean);
  emakit::update_together(fast, warm, mean);
  CHECK(emakit::detail::testing::sync_counts().fused_groupings == groupings + 4);
}

TEST_CASE("EMAs of any policies through EmaBase: the update, the group, the state and find_policy are the typed "
          "Ema's",
          "[together][base]") {
  emakit_test::TinyNet model;
  // The same three EMAs twice: one set held as EmaBase pointers (a trainer's list of EMAs of
  // several types), the other updated through the typed Emas.
  std::vector<std::unique_ptr<emakit::EmaBase>> held;
  held.push_back(std::make_unique<emakit::Ema<emakit::Fixed>>(*model, emakit::Fixed(0.9)));
  held.push_back(std::make_unique<emakit::Ema<emakit::InversePowerWarmup>>(*model));
  held.push_back(std::make_unique<emakit::Ema<emakit::Uniform>>(*model, emakit::Uniform(),
                                                                emakit::StepSchedule().update_every(2)));
  emakit::Ema<emakit::Fixed> fast(*model, emakit::Fixed(0.9));
  emakit::Ema<emakit::InversePowerWarmup> warm(*model);
  emakit::Ema<emakit::Uniform> mean(*model, emakit::Uniform(), emakit::StepSchedule().update_every(2));
  std::vector<emakit::EmaBase*> pointers;
  for (auto& e : held) pointers.push_back(e.get());
  emakit::EmaGroup group(pointers);
  REQUIRE(group.size() == 3);
  std::size_t compared = 0;
  for (int step = 1; step <= 6; ++step) {
    emakit_test::perturb(*model);
    // Odd steps: the group of base pointers; even steps: each base pointer's own update().
    std::vector<emakit::UpdateResult> results;
    if (step % 2 == 1) {
      const auto r = group.update();
      results.assign(r.begin(), r.end());
    } else {
      for (auto& e : held) results.push_back(e->update());
    }
    const emakit::UpdateResult typed[] = {fast.update(), warm.update(), mean.update()};
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(same_result(results[i], typed[i]));
      ++compared;
    }
  }
  CHECK(compared == 18);
  const emakit::EmaBase* typed_bases[] = {&fast, &warm, &mean};
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(emakit_test::same_averages(held[i]->averages(), emakit_test::snapshot(typed_bases[i]->averages())));
    CHECK(held[i]->num_updates() == typed_bases[i]->num_updates());
    CHECK(held[i]->decay() == typed_bases[i]->decay());
  }
  CHECK(mean.num_updates() == 3);  // update_every(2): the schedule of the derived Ema decided

  // The state through the base carries the derived Ema's policies: a state of another config is
  // refused by name, through the base as through the type.
  emakit::Ema<emakit::Fixed> reloaded(*model, emakit::Fixed(0.9));
  emakit::EmaBase& base = reloaded;
  CHECK(base.load_state_dict(held[0]->state_dict()).clean());
  CHECK(emakit_test::same_averages(reloaded.averages(), emakit_test::snapshot(fast.averages())));
  CHECK(reloaded.step() == 6);
  CHECK_THROWS_WITH(base.load_state_dict(held[1]->state_dict()), Catch::Contains("InversePowerWarmup"));
  CHECK(reloaded.step() == 6);

  // find_policy: the derived Ema's own policy objects, and null for a type it does not have.
  const auto& f = dynamic_cast<const emakit::Ema<emakit::Fixed>&>(*held[0]);
  CHECK(held[0]->find_policy<emakit::Fixed>() == &f.decay_policy());
  CHECK(held[0]->find_policy<emakit::Fixed>()->beta() == 0.9);
  CHECK(held[0]->find_policy<emakit::StepSchedule>() == &f.schedule());
  CHECK(held[0]->find_policy<emakit::FlatStorage>() != nullptr);
  CHECK(held[0]->find_policy<emakit::Uniform>() == nullptr);
  CHECK(held[1]->find_policy<emakit::Fixed>() == nullptr);
  CHECK(held[1]->find_policy<emakit::InversePowerWarmup>() != nullptr);
  CHECK(held[2]->find_policy<emakit::StepSchedule>()->update_every() == 2);

  // A null member is refused by position, before anything changes.
  const auto steps = held[0]->step();
  CHECK_THROWS_WITH(emakit::EmaGroup(std::vector<emakit::EmaBase*>{held[0].get(), nullptr}),
                    Catch::Contains("member 1 is a null pointer"));
  CHECK(held[0]->step() == steps);
}

namespace {
// A schedule that, when it decides, calls another Ema's update(): what a second thread would do
// while update_together runs.
struct Intruding {
  std::function<void()> intrude;
  emakit::Decision decide(const emakit::ScheduleInput& in) const {
    if (intrude) intrude();
    return {emakit::Action::averaged, in.given_step.value_or(in.previous_step + 1)};
  }
};
}  // namespace

TEST_CASE("update_together holds every member's update until it is done, and gives them back after a refusal",
          "[together][errors]") {
  emakit_test::TinyNet model;
  emakit::Ema<emakit::Fixed> first(*model, emakit::Fixed(0.9)), second(*model, emakit::Fixed(0.9));
  emakit::Ema<emakit::Fixed, Intruding> intruder(*model, emakit::Fixed(0.9), Intruding{[&] { second.update(); }});
  CHECK_THROWS_WITH(emakit::update_together(first, second, intruder),
                    Contains("another update() of this Ema is running"));
  CHECK(first.calls() == 0);
  CHECK(second.calls() == 0);
  // Every flag was given back: each member updates again, alone and together.
  first.update();
  second.update();
  emakit::Ema<emakit::Fixed, Intruding> quiet(*model, emakit::Fixed(0.9), Intruding{});
  emakit::update_together(first, second, quiet);
  CHECK(first.calls() == 2);
  CHECK(quiet.calls() == 1);
  // An update_together refused at a busy member gives back the members it had taken before it.
  emakit::Ema<emakit::Fixed> third(*model, emakit::Fixed(0.9));
  emakit::Ema<emakit::Fixed, Intruding> nested(*model, emakit::Fixed(0.9),
                                               Intruding{[&] { emakit::update_together(third, second); }});
  CHECK_THROWS_WITH(emakit::update_together(first, second, nested),
                    Contains("update_together() was called while another update() of this Ema is running"));
  CHECK(third.update().action != emakit::Action::skipped);  // third was given back by the inner call
  CHECK(third.calls() == 1);
}

// The CPU passes hold the data pointers of their plan: a tensor given new memory (set_data, same
// shape and dtype, the old memory freed) must be found before the pass runs, by Ema's update, by
// update_together's reused grouping, and by a kernel run that nobody checked first.
TEST_CASE("A model tensor given new memory between updates is read there: apart, together, and a bare kernel run",
          "[together][placement]") {
  for (const bool together : {false, true}) {
    emakit_test::TinyNet model;
    emakit_test::fill_floats(*model, 1.0);
    emakit::FixedEma fast(*model, emakit::Fixed(0.5)), slow(*model, emakit::Fixed(0.75));
    auto update = [&] {
      if (together) {
        emakit::update_together(fast, slow);
      } else {
        fast.update();
        slow.update();
      }
    };
    update();  // 1 and 1 stay 1; together, the members' passes are grouped (and kept for the next call)
    {
      torch::NoGradGuard no_grad;
      model->fc->weight.set_data(torch::full({4, 3}, 3.0));
    }
    update();
    INFO((together ? "together" : "apart"));
    CHECK(torch::equal(fast.average("fc.weight"), torch::full({4, 3}, 2.0)));  // 1 + 0.5 (3 - 1)
    CHECK(torch::equal(slow.average("fc.weight"), torch::full({4, 3}, 1.5)));  // 1 + 0.25 (3 - 1)
    CHECK(torch::equal(fast.average("fc.bias"), torch::full({4}, 1.0)));       // untouched tensors still right
  }
  std::vector<emakit::detail::Slot> slots(1);
  slots[0].name = "t";
  slots[0].average = torch::ones({1000});
  slots[0].source = torch::ones({1000});
  at::Tensor source = slots[0].source;  // the same tensor (TensorImpl) as the slot's
  emakit::detail::UpdateKernel kernel(std::move(slots));
  source.set_data(torch::full({1000}, 3.0));
  kernel.average(0.5);  // no check_sources_and_replan() before it
  CHECK(torch::equal(kernel.settled_slots()[0].average, torch::full({1000}, 2.0)));
}

TEST_CASE("update_together refuses, before anything changes, what one pass cannot update", "[together][errors]") {
  emakit_test::TinyNet model, other;
  emakit::Ema<emakit::Fixed> a(*model, emakit::Fixed(0.9)), b(*model, emakit::Fixed(0.99));
  emakit::Ema<emakit::Fixed> elsewhere(*other, emakit::Fixed(0.9));
  emakit::Ema<emakit::Fixed> switching(*model, emakit::Fixed(0.9), {},
                                       emakit::EmaOptions().switch_model(/*every=*/2, /*beta=*/0.5));
  const auto unchanged = [&] {
    CHECK(a.calls() == 0);
    CHECK(b.calls() == 0);
    CHECK(elsewhere.calls() == 0);
    CHECK(switching.calls() == 0);
  };
  CHECK_THROWS_WITH(emakit::update_together(a, b, a),
                    Contains("update_together: the same Ema is given twice (members 0 and 2)"));
  unchanged();
  CHECK_THROWS_WITH(emakit::update_together(a, elsewhere),
                    Contains("update_together: member 1 is bound to another model than member 0 (they hold no "
                             "model tensor in common)"));
  unchanged();
  // An EMA of the model and one of its sub-module: two modules, which share the sub-module's tensors.
  emakit::Ema<emakit::Fixed> part(*model->fc, emakit::Fixed(0.9));
  CHECK_THROWS_WITH(emakit::update_together(a, part),
                    Contains("update_together: member 1 is bound to another model than member 0 (another module, "
                             "though they read some of the same tensors, e.g. 'weight'"));
  CHECK(part.calls() == 0);
  unchanged();
  CHECK_THROWS_WITH(emakit::update_together(a, switching),
                    Contains("update_together: member 1 writes the model after its update (EmaOptions::switch_model)"));
  unchanged();
  {
    auto guard = b.swap_into();  // the model holds b's average now
    CHECK_THROWS_WITH(emakit::update_together(a, b),
                      Contains("update_together: member 0: an update while the model holds another Ema's weights"));
    CHECK_THROWS_WITH(emakit::update_together(b, a),
                      Contains("update_together: member 0: an update while a SwapGuard holds the EMA weights"));
  }
  unchanged();
  // A step going back, for one member: nothing moves for the other either.
  emakit::Ema<emakit::Fixed> c(*model, emakit::Fixed(0.9)), d(*model, emakit::Fixed(0.9));
  emakit::update_together(emakit::StepInfo{.step = 5}, c, d);
  CHECK(c.step() == 5);
  d.update({.step = 6});
  const auto before = emakit_test::snapshot(c.averages());
  CHECK_THROWS(emakit::update_together(emakit::StepInfo{.step = 6}, c, d));
  CHECK(c.step() == 5);
  CHECK(d.step() == 6);
  CHECK(emakit_test::same_averages(c.averages(), before));
}

namespace {
using emakit::detail::CpuPath;
using emakit::detail::Slot;
using emakit::detail::UpdateKernel;

// Averaged and copied slots of every dtype pair the kernel reads (fused pairs, and pairs only
// ATen's lerp_ takes: a bf16 or fp16 average of an fp32 source), of sizes around the chunk, block
// and parallel grain, some transposed (staged); averages start elsewhere than their sources.
std::vector<Slot> drift_slots(std::uint64_t seed, std::string& text) {
  std::mt19937_64 rng(seed);
  const auto below = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
  const std::vector<std::pair<c10::ScalarType, c10::ScalarType>> pairs = {
      {at::kFloat, at::kFloat},   {at::kFloat, at::kBFloat16}, {at::kFloat, at::kHalf},
      {at::kDouble, at::kDouble}, {at::kDouble, at::kFloat},   {at::kBFloat16, at::kBFloat16},
      {at::kHalf, at::kHalf},     {at::kHalf, at::kFloat},     {at::kBFloat16, at::kFloat}};
  std::vector<Slot> slots;
  const int n_slots = 1 + below(6);
  for (int i = 0; i < n_slots; ++i) {
    const auto [a_type, s_type] = pairs[static_cast<std::size_t>(below(static_cast<int>(pairs.size())))];
    const std::int64_t n = std::vector<std::int64_t>{0, 1, 7, 1025, 2049, 40000, 70001}[below(7)];
    Slot s;
    s.name = "t" + std::to_string(i);
    s.source = at::randn({n}).to(s_type);
    if (n > 1 && below(4) == 0) s.source = at::randn({2, n}).to(s_type).t();  // strided: staged
    s.average = (at::randn(s.source.sizes()) * (1 + below(3)) + s.source.to(at::kFloat)).to(a_type).contiguous();
    s.averaged = below(6) != 0;
    if (!s.averaged) s.average = at::zeros(s.source.sizes(), s.source.options()).contiguous();
    text += fmt::format("{}{} <- {}[{}]{} ", s.averaged ? "" : "copied ", c10::toString(s.average.scalar_type()),
                        c10::toString(s_type), n, s.source.is_contiguous() ? "" : " strided");
    slots.push_back(std::move(s));
  }
  return slots;
}

std::vector<Slot> clone_slots(const std::vector<Slot>& slots) {
  std::vector<Slot> out;
  for (const auto& s : slots) {
    Slot c;
    c.name = s.name;
    c.source = s.source;  // the same model tensor
    c.average = s.average.clone();
    c.averaged = s.averaged;
    out.push_back(std::move(c));
  }
  return out;
}
}  // namespace

TEST_CASE("Drift sums are those of the averages as written, on the fused pass and the foreach path, and change no "
          "average",
          "[together][drift]") {
  std::size_t sums_compared = 0, outside = 0, in_pass = 0;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    torch::manual_seed(seed);
    std::string text;
    const std::vector<Slot> slots = drift_slots(seed, text);
    INFO("seed " << seed << ": " << text);
    for (const CpuPath path : {CpuPath::fused, CpuPath::foreach}) {
      INFO((path == CpuPath::fused ? "fused pass" : "foreach path"));
      for (const double w : {0.01, 0.7}) {  // both of the lerp's branches
        INFO("w " << w);
        UpdateKernel measured(clone_slots(slots), path), plain(clone_slots(slots), path);
        measured.average(w, UpdateKernel::DriftMeasure::measure);
        plain.average(w);
        for (std::size_t i = 0; i < slots.size(); ++i) {
          const Slot& s = measured.slots()[i];
          INFO(s.name);
          REQUIRE(same_bits(s.average, plain.slots()[i].average));  // measuring changes nothing
          const double got_d2 = measured.drift_sums()[2 * i], got_x2 = measured.drift_sums()[2 * i + 1];
          if (!s.averaged) {
            CHECK(got_d2 == 0.0);
            CHECK(got_x2 == 0.0);
            continue;
          }
          const at::Tensor a = s.average.to(at::kDouble), x = s.source.to(at::kDouble);
          const double d2 = (a - x).square().sum().item<double>(), x2 = x.square().sum().item<double>();
          INFO("d2 " << got_d2 << " (exact " << d2 << "), x2 " << got_x2 << " (exact " << x2 << ")");
          CHECK(std::abs(got_d2 - d2) <= drift_bound(d2, s.average.scalar_type()));
          CHECK(std::abs(got_x2 - x2) <= drift_bound(x2, s.average.scalar_type()));
          ++sums_compared;
        }
      }
    }
    // Which slots the fused pass measures itself, and which the ATen ops after it (non-fused pairs).
    const UpdateKernel fused(clone_slots(slots), CpuPath::fused);
    for (const auto& s : fused.slots()) {
      if (!s.averaged || s.average.numel() == 0) continue;
      (emakit::detail::fused_pair(s.average.scalar_type(), s.source.scalar_type()) ? in_pass : outside) += 1;
    }
  }
  INFO("sums compared " << sums_compared);
  CHECK(sums_compared >= 200);
  CHECK(in_pass >= 20);  // both kinds of slot of the fused path were measured
  CHECK(outside >= 5);
}

// The fused pass's drift sums do not depend on how its tensors are cut between threads (each
// drift chunk is one thread's, added up in order after the pass); those that ATen's reductions
// take (slots outside the pass: dtype pairs the pass does not fuse) follow ATen's threads. Either
// way a kernel in a group measures what it measures alone.
TEST_CASE("The fused pass's drift sums are the same bits with any number of threads, alone and in a group of kernels",
          "[together][drift]") {
  const int threads_before = at::get_num_threads();
  std::size_t compared = 0, across_threads = 0;
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    torch::manual_seed(seed);
    std::string text;
    std::vector<Slot> slots = drift_slots(seed, text);
    // One tensor of several parallel grains: the threads' shares cut it (and the others, at times).
    Slot big;
    big.name = "big";
    big.source = at::randn({300001});
    big.average = (big.source + at::randn({300001})).contiguous();
    big.averaged = true;
    slots.push_back(std::move(big));
    INFO("seed " << seed << ": " << text << "float <- float[300001]");
    std::vector<double> alone_1, group_1;  // the sums with one thread
    for (const int threads : {1, 2, 5}) {
      at::set_num_threads(threads);
      REQUIRE(at::get_num_threads() == threads);
      INFO(threads << " threads");
      UpdateKernel alone(clone_slots(slots), CpuPath::fused), first(clone_slots(slots), CpuPath::fused),
          second(clone_slots(slots), CpuPath::fused);
      alone.average(0.3, UpdateKernel::DriftMeasure::measure);
      const auto measuring = [](emakit::detail::Weights w) {
        return UpdateKernel::Job{UpdateKernel::Kind::average, w, UpdateKernel::DriftMeasure::measure};
      };
      const UpdateKernel::Work work[] = {{&first, measuring({0.3, 0.7})}, {&second, measuring({0.01, 0.99})}};
      UpdateKernel::TogetherScratch scratch;
      UpdateKernel::run_together(work, scratch);
      std::vector<double> alone_sums(alone.drift_sums().begin(), alone.drift_sums().end());
      std::vector<double> group_sums(first.drift_sums().begin(), first.drift_sums().end());
      group_sums.insert(group_sums.end(), second.drift_sums().begin(), second.drift_sums().end());
      if (threads == 1) {
        alone_1 = alone_sums;
        group_1 = group_sums;
      }
      // The group's first member is the kernel alone, run with another beside it.
      REQUIRE(alone_sums.size() == slots.size() * 2);
      for (std::size_t i = 0; i < group_sums.size(); ++i) {
        const Slot& slot = slots[i % slots.size()];
        INFO("sum " << i << " (" << slot.name << "): " << group_sums[i] << ", with one thread " << group_1[i]);
        if (i < alone_sums.size()) CHECK(same_double(group_sums[i], alone_sums[i]));
        ++compared;
        if (!emakit::detail::fused_pair(slot.average.scalar_type(), slot.source.scalar_type())) continue;
        CHECK(same_double(group_sums[i], group_1[i]));
        if (i < alone_sums.size()) CHECK(same_double(alone_sums[i], alone_1[i]));
        across_threads += threads > 1 ? 1 : 0;
      }
      CHECK(alone_sums[alone_sums.size() - 2] > 0.0);  // the big tensor was measured
    }
  }
  at::set_num_threads(threads_before);
  INFO("sums compared " << compared << ", across threads " << across_threads);
  CHECK(compared >= 12 * 3 * 4);
  CHECK(across_threads >= 12 * 2 * 4);  // the big tensor's, at least
}

TEST_CASE("drift_every measures on every n-th averaging update: the result, last_drift(), describe() and the "
          "farthest tensor",
          "[together][drift]") {
  torch::manual_seed(3);
  std::vector<emakit::SourceTensor> model = {{"near", at::randn({3000})},
                                             {"far", at::randn({500})},
                                             {"half", at::randn({70001}).to(at::kHalf)},
                                             {"steps", at::zeros({1}, at::kLong), /*buffer=*/true}};
  // The exact relative distance of the averages from the model, and of one tensor.
  const auto exact = [&](const auto& ema, const std::string& only) {
    double d2 = 0, x2 = 0;
    for (const auto& s : model) {
      if (!s.tensor.is_floating_point() || (!only.empty() && s.name != only)) continue;
      const at::Tensor a = ema.average(s.name).to(at::kDouble), x = s.tensor.to(at::kDouble);
      d2 += (a - x).square().sum().item<double>();
      x2 += x.square().sum().item<double>();
    }
    return std::sqrt(d2 / x2);
  };
  emakit::Ema<emakit::Fixed> ema(model, emakit::Fixed(0.9), {}, emakit::EmaOptions().drift_every(2));
  emakit::Ema<emakit::Fixed> off(model, emakit::Fixed(0.9));
  CHECK_FALSE(ema.last_drift().has_value());
  std::size_t measured = 0;
  for (int step = 1; step <= 7; ++step) {
    INFO("step " << step);
    {
      torch::NoGradGuard no_grad;
      for (auto& s : model)
        if (s.tensor.is_floating_point()) s.tensor.add_(at::randn(s.tensor.sizes()).to(s.tensor.scalar_type()), 0.1);
      model[1].tensor.add_(at::randn({500}), 3.0);  // "far" jumps every step
    }
    const auto r = ema.update();
    off.update();
    CHECK(emakit_test::same_averages(ema.averages(), emakit_test::snapshot(off.averages())));
    const bool due = r.action == emakit::Action::averaged && ema.num_updates() % 2 == 0;
    REQUIRE(r.drift.has_value() == due);
    if (!due) continue;
    ++measured;
    CHECK(r.drift->step == step);
    CHECK(close_drift(r.drift->relative, exact(ema, "")));
    CHECK(r.drift->farthest == "far");
    CHECK(close_drift(r.drift->farthest_relative, exact(ema, "far")));
    REQUIRE(ema.last_drift().has_value());
    CHECK(ema.last_drift()->relative == r.drift->relative);
    CHECK_THAT(fmt::format("{}", r), Contains(fmt::format(", drift {:.4g} (farthest 'far'", r.drift->relative)));
    CHECK_THAT(fmt::format("{}", ema),
               Contains(fmt::format("drift={:.4g} at step {} (farthest 'far'", r.drift->relative, step)) &&
                   Contains("window=10 steps"));
  }
  CHECK(measured == 3);  // updates 2, 4 and 6 averaged (the first copies)
  CHECK_THAT(fmt::format("{}", off), !Contains("drift="));

  // A NaN that reaches the average makes the drift NaN and its tensor the farthest.
  {
    torch::NoGradGuard no_grad;
    model[0].tensor[5] = std::nan("");
  }
  emakit::Ema<emakit::Fixed> every(model, emakit::Fixed(0.9), {}, emakit::EmaOptions().drift_every(1));
  every.update();  // a copy: not measured
  const auto r = every.update();
  REQUIRE(r.drift.has_value());
  CHECK(std::isnan(r.drift->relative));
  CHECK(r.drift->farthest == "near");
  CHECK_THROWS_WITH(emakit::EmaOptions().drift_every(-1), Contains("EmaOptions::drift_every"));
}

namespace {
std::unique_ptr<std::vector<int>> kept_alive;  // NOLINT: the control allocation, out of the optimizer's reach

// The allocations f() makes, on any thread.
template <class F>
long allocations_of(F&& f) {
  using namespace test_together_allocations;
  made = 0;
  counting = true;
  f();
  counting = false;
  return made.load();
}
}  // namespace

TEST_CASE("An EmaGroup checks its members once and then allocates nothing per update, nor does an Ema's update()",
          "[together][allocation]") {
  torch::manual_seed(21);
  emakit_test::TinyNet model;
  torch::nn::Linear wide(512, 512);  // 262k elements: the pass is cut between threads
  emakit::Ema<emakit::Fixed> fast(*model, emakit::Fixed(0.9)), alone(*model, emakit::Fixed(0.9));
  emakit::Ema<emakit::InversePowerWarmup> warm(*model);
  emakit::Ema<emakit::Uniform> mean(*model);
  emakit::Ema<emakit::Fixed> wide_fast(*wide, emakit::Fixed(0.9)), wide_slow(*wide, emakit::Fixed(0.99));
  emakit::EmaGroup group(fast, warm, mean);
  emakit::EmaGroup wide_group(wide_fast, wide_slow);
  // The counter sees allocations: this one must be counted, or the test proves nothing.
  CHECK(allocations_of([] { kept_alive = std::make_unique<std::vector<int>>(1000); }) >= 1);
  kept_alive.reset();
  const auto groupings = emakit::detail::testing::sync_counts().fused_groupings;
  for (int step = 1; step <= 6; ++step) {
    INFO("step " << step);
    emakit_test::perturb(*model);
    {
      torch::NoGradGuard no_grad;
      wide->weight.add_(torch::randn_like(wide->weight), 0.1);
    }
    std::span<const emakit::UpdateResult> results, wide_results;
    emakit::UpdateResult own;
    const long made = allocations_of([&] {
      results = group.update();
      wide_results = wide_group.update();
      own = alone.update();
    });
    // The first update groups the passes (and sizes the scratch); from the second on nothing is allocated.
    if (step > 1) CHECK(made == 0);
    REQUIRE(results.size() == 3);
    CHECK(results[0].action == emakit::Action::averaged);
    CHECK(same_result(results[0], own));  // `fast` in the group is `alone` apart
    CHECK(wide_results[1].step == step);
  }
  CHECK(emakit_test::same_averages(fast.averages(), emakit_test::snapshot(alone.averages())));
  // Each group grouped its passes once (their plans did not change) and reused the grouping.
  CHECK(emakit::detail::testing::sync_counts().fused_groupings == groupings + 2);
}

TEST_CASE("An EmaGroup refuses at construction what update_together refuses, and a member moved from at update",
          "[together][errors]") {
  emakit_test::TinyNet model, other;
  emakit::Ema<emakit::Fixed> a(*model, emakit::Fixed(0.9)), b(*model, emakit::Fixed(0.9)),
      c(*other, emakit::Fixed(0.9));
  CHECK_THROWS_WITH(emakit::EmaGroup(a, a), Contains("the same Ema is given twice (members 0 and 1)"));
  CHECK_THROWS_WITH(emakit::EmaGroup(a, c), Contains("member 1 is bound to another model than member 0"));
  emakit::EmaGroup group(a, b);
  group.update();
  CHECK(a.num_updates() == 1);
  emakit::Ema<emakit::Fixed> taken = std::move(b);
  CHECK_THROWS_WITH(group.update(), Contains("update_together() on a moved-from Ema"));
  CHECK(a.num_updates() == 1);  // refused before anything changed
  CHECK(taken.num_updates() == 1);
}

}  // namespace test_together
