// emakit::update_together (together.hpp): several EMAs of one model updated in one pass must be
// exactly, bitwise, what each one's own update() gives, counters and UpdateResults included. A
// differential test over generated cases: sources of every dtype and layout the update reads
// (fp32, bf16, fp16, fp64, integers; contiguous, transposed, zero-size, large enough to be cut
// between threads and blocks), members with their own decay, schedule (start, every, offset,
// warmup mode), buffer and dtype options, vetoed steps and non-finite steps; against the same
// members updated one by one, on the same model.
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/linear.h>

#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

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
  const int k = 2 + below(3);
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
        .buffers(std::vector<emakit::BufferMode>{emakit::BufferMode::average, emakit::BufferMode::copy,
                                                 emakit::BufferMode::ignore}[below(3)])
        .keep_model_dtype(below(3) == 0)
        .skip_non_finite(below(2) == 0);
    c.text += fmt::format("| member {}: beta {:.3f} warmup {} start {} every {} offset {} mode {} buffers {} keep {} "
                          "skip_non_finite {} ",
                          m, decay.beta(), decay.warmup(), schedule.start_step(), schedule.update_every(),
                          schedule.every_offset(), static_cast<int>(schedule.warmup()),
                          static_cast<int>(options.buffers()), options.keep_model_dtype(), options.skip_non_finite());
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

bool same_result(const emakit::UpdateResult& a, const emakit::UpdateResult& b) {
  return a.action == b.action && a.step == b.step && a.non_finite == b.non_finite &&
         std::bit_cast<std::uint64_t>(a.decay) == std::bit_cast<std::uint64_t>(b.decay);
}

}  // namespace

TEST_CASE("update_together is bitwise each member's own update(), over generated models, schedules and options",
          "[together]") {
  const char* env = std::getenv("EMAKIT_TOGETHER_CASES");  // more cases on demand
  const std::uint64_t cases = env != nullptr ? std::stoull(env) : 40;
  constexpr int kSteps = 12;
  std::size_t tensors_compared = 0, results_compared = 0, fused_cases = 0, fallback_cases = 0;
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
      const std::uint64_t fused_before = emakit::detail::sync_counts().fused_calls;
      const auto results = emakit::update_together(std::span<Member>(together), info);
      fused = fused || emakit::detail::sync_counts().fused_calls > fused_before;
      REQUIRE(results.size() == apart.size());
      for (std::size_t m = 0; m < apart.size(); ++m) {
        INFO("member " << m);
        const auto own = apart[m].update(info);
        REQUIRE(same_result(results[m], own));
        ++results_compared;
      }
      for (std::size_t m = 0; m < apart.size(); ++m) tensors_compared += require_same(together[m], apart[m]);
    }
    // With every member's update the fused pass, the members were fused whenever two of them applied.
    if (c.all_fused) {
      fused_cases += fused ? 1 : 0;
    } else {
      fallback_cases += 1;
    }
  }
  INFO("tensors compared " << tensors_compared << ", results " << results_compared);
  CHECK(results_compared >= cases * kSteps * 2);
  CHECK(tensors_compared > results_compared);
  CHECK(fused_cases > cases / 3);  // the fused path ran (most generated cases have every source contiguous)
  CHECK(fallback_cases > 0);       // and so did the members' own kernels (transposed sources)
  std::cout << "update_together: " << cases << " cases, " << results_compared << " results and " << tensors_compared
            << " tensors compared bitwise; " << fused_cases << " cases fused, " << fallback_cases
            << " with a member's own kernel" << std::endl;
}

TEST_CASE("update_together of different Ema types, and PostHocEma's profiles, run one fused pass", "[together]") {
  emakit_test::TinyNet model;
  emakit::Ema<emakit::Fixed> fast(*model, emakit::Fixed(0.9));
  emakit::Ema<emakit::InversePowerWarmup> warm(*model);
  emakit::Ema<emakit::Uniform> mean(*model);
  emakit::Ema<emakit::Fixed> fast2(*model, emakit::Fixed(0.9));
  emakit::Ema<emakit::InversePowerWarmup> warm2(*model);
  emakit::Ema<emakit::Uniform> mean2(*model);
  const auto groupings = emakit::detail::sync_counts().fused_groupings;
  for (int step = 1; step <= 5; ++step) {
    emakit_test::perturb(*model);
    const auto calls = emakit::detail::sync_counts().fused_calls;
    const auto results = emakit::update_together(fast, warm, mean);
    CHECK(emakit::detail::sync_counts().fused_calls == calls + 1);
    CHECK(same_result(results[0], fast2.update()));
    CHECK(same_result(results[1], warm2.update()));
    CHECK(same_result(results[2], mean2.update()));
  }
  CHECK(emakit_test::same_averages(fast.averages(), emakit_test::snapshot(fast2.averages())));
  CHECK(emakit_test::same_averages(warm.averages(), emakit_test::snapshot(warm2.averages())));
  CHECK(emakit_test::same_averages(mean.averages(), emakit_test::snapshot(mean2.averages())));
  CHECK(fast.num_updates() == 5);
  // The members' segments were grouped at the first call only (their plans did not change); the
  // later calls took the grouping with their new weights (warm's and mean's change every step).
  CHECK(emakit::detail::sync_counts().fused_groupings == groupings + 1);
  // Another set of members is grouped anew, and so is the first set after it.
  emakit::update_together(fast2, warm2);
  emakit::update_together(fast, warm, mean);
  CHECK(emakit::detail::sync_counts().fused_groupings == groupings + 3);
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
                    Contains("update_together: member 1 is bound to another model than member 0"));
  unchanged();
  CHECK_THROWS_WITH(emakit::update_together(a, switching),
                    Contains("update_together: member 1 writes the model after its update (EmaOptions::switch_model)"));
  unchanged();
  {
    auto guard = b.swap_into();  // the model holds b's average now
    CHECK_THROWS_WITH(emakit::update_together(a, b), Contains("while the model holds another Ema's weights"));
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
