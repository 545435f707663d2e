// The update kernel: the fused CPU pass against ATen's lerp for every dtype pair, chunking and
// threads, staging, and an update that allocates nothing. The foreach path of CUDA devices, run
// on CPU tensors: its lists, its bounded staging pool and its non-finite check, with the aten
// ops each update dispatches counted (RecordFunction).
#include <emakit/aliases.hpp>
#include <emakit/detail/cpu_pass.hpp>
#include <emakit/detail/module_tensors.hpp>
#include <emakit/detail/simd.hpp>
#include <emakit/detail/update_kernel.hpp>
#include <emakit/together.hpp>

#include "helpers.hpp"
#include "op_census.hpp"
#include "skip.hpp"

#include <fmt/ranges.h>  // formats shapes
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <new>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>

#include <sys/utsname.h>

namespace test_kernel {  // this file's names (unity batches: tests/CMakeLists.txt)

namespace {

// Averages `a` towards `x` with weight w through the kernel; returns the result.
using CpuPath = emakit::detail::UpdateKernel::CpuPath;
using SideStream = emakit::detail::SideStream;

torch::Tensor kernel_lerp(const torch::Tensor& a, const torch::Tensor& x, double w, CpuPath path = CpuPath::fused) {
  std::vector<emakit::detail::Slot> slots(1);
  slots[0].name = "t";
  slots[0].average = a.clone();
  slots[0].source = x;
  emakit::detail::UpdateKernel kernel(std::move(slots), path);
  kernel.average(w);
  return kernel.settled_slots()[0].average;
}

}  // namespace

namespace {
// One averaged element as each Arithmetic defines it (options.hpp), written out element by element
// as the peer's ATen ops compute it: each op's result rounded to the average's dtype A, written
// through a volatile so that no compiler contracts two of them into an FMA; the fused forms by
// std::fma. T is the opmath type (float, double for double averages).
template <class A, class T>
T through(T v) {
  volatile T r = static_cast<T>(static_cast<A>(v));
  return r;
}
template <class A, class T>
A reference_element(emakit::Arithmetic f, T a, T x, T w, T d) {
  using emakit::Arithmetic;
  const bool low = std::abs(w) < T(0.5);
  switch (f) {
    case Arithmetic::lerp: {
      volatile T diff = x - a;
      volatile T prod = (low ? w : w - T(1)) * diff;
      return static_cast<A>((low ? a : x) + prod);
    }
    case Arithmetic::fused_lerp: return static_cast<A>(std::fma(low ? w : w - T(1), T(x - a), low ? a : x));
    case Arithmetic::weighted_sum: return static_cast<A>(through<A>(d * a) + through<A>(w * x));
    case Arithmetic::scaled_fused_add: return static_cast<A>(std::fma(x, w, through<A>(d * a)));
    case Arithmetic::subtract: return static_cast<A>(a - through<A>(w * through<A>(a - x)));
    case Arithmetic::fused_subtract: return static_cast<A>(std::fma(-w, through<A>(a - x), a));
  }
  return A(0);
}

// reference_element over tensors of a fused pair (the source read in opmath, exactly).
torch::Tensor reference_average(emakit::Arithmetic f, const torch::Tensor& a, const torch::Tensor& x,
                                emakit::detail::Weights k) {
  torch::Tensor out = a.clone();
  emakit::detail::dispatch_pair(a.scalar_type(), x.scalar_type(), [&](auto* a_tag, auto* s_tag) {
    using A = std::remove_pointer_t<decltype(a_tag)>;
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s_tag)>>;
    using T = emakit::detail::opmath_t<A>;
    A* o = out.data_ptr<A>();
    const S* xs = x.data_ptr<S>();
    for (std::int64_t i = 0; i < out.numel(); ++i)
      o[i] = reference_element<A, T>(f, static_cast<T>(o[i]), static_cast<T>(xs[i]), static_cast<T>(k.weight),
                                     static_cast<T>(k.decay));
  });
  return out;
}

// Whether this LibTorch's CPU add with alpha, a + alpha * b (the op of scaled_fused_add and
// fused_subtract on the foreach path), rounds once here: fma(b, alpha, a) at every element of a
// vector body and a scalar tail (4099 elements), as ATen computes it on a CPU capability with FMA
// (AVX2, AVX-512); its baseline capability rounds the product first. From a generator of its own.
bool aten_add_alpha_fuses() {
  auto generator = at::detail::createCPUGenerator(5);
  const auto a = torch::randn({4099}, generator), b = torch::randn({4099}, generator);
  const float alpha = 0.1f;
  const auto got = a.add(b, alpha);
  const auto av = a.accessor<float, 1>(), bv = b.accessor<float, 1>(), gv = got.accessor<float, 1>();
  std::int64_t fused = 0, products_rounded = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    volatile float product = bv[i] * alpha;
    fused += gv[i] == std::fma(bv[i], alpha, av[i]) ? 1 : 0;
    products_rounded += gv[i] == av[i] + product ? 1 : 0;
  }
  REQUIRE(std::max(fused, products_rounded) == a.numel());  // one of the two, everywhere
  REQUIRE(std::min(fused, products_rounded) < a.numel());   // and the data tells them apart
  return fused == a.numel();
}
}  // namespace

TEST_CASE("Every Arithmetic computes its peer's formula, bitwise, on the fused pass, with drift and together",
          "[kernel]") {
  using emakit::Arithmetic;
  using emakit::detail::UpdateKernel;
  torch::manual_seed(11);
  const std::vector<std::pair<c10::ScalarType, c10::ScalarType>> pairs = {
      {torch::kFloat, torch::kFloat},   {torch::kFloat, torch::kBFloat16}, {torch::kFloat, torch::kHalf},
      {torch::kDouble, torch::kDouble}, {torch::kDouble, torch::kFloat},   {torch::kBFloat16, torch::kBFloat16},
      {torch::kHalf, torch::kHalf}};
  const auto& arithmetics = emakit::all_arithmetics;
  // d as a decay policy gives it and w = 1 - d in double (1 - w is not d in every bit: 0.1, 0.9999),
  // both forms of the lerps (w < 0.5 and not) and w = 1.
  const double decays[] = {0.999, 0.9999, 0.1, 0.3, 0.7, 0.0};
  // The n of each tensor: vector bodies, scalar tails, and one cut between threads' shares.
  const std::int64_t sizes[] = {1, 37, 1000 + 13, UpdateKernel::chunk_elements * 2 + 5};
  std::size_t compared = 0, not_lerp = 0, differs_from_lerp = 0;
  for (const auto& [a_type, s_type] : pairs) {
    for (const Arithmetic f : arithmetics) {
      for (const double d : decays) {
        const emakit::detail::Weights k{1.0 - d, d};
        INFO(emakit::arithmetic_name(f) << ": " << c10::toString(a_type) << " from " << c10::toString(s_type) << ", d "
                                        << d);
        std::vector<emakit::detail::Slot> slots(std::size(sizes));
        std::vector<torch::Tensor> start, want;
        for (std::size_t i = 0; i < slots.size(); ++i) {
          slots[i].name = "t" + std::to_string(i);
          slots[i].source = torch::randn({sizes[i]}).to(s_type);
          slots[i].average = torch::randn({sizes[i]}).to(a_type);
          start.push_back(slots[i].average.clone());
          want.push_back(reference_average(f, slots[i].average, slots[i].source, k));
        }
        std::vector<emakit::detail::Slot> copies = slots, grouped = slots;
        for (auto& s : copies) s.average = s.average.clone();
        for (auto& s : grouped) s.average = s.average.clone();
        UpdateKernel plain(std::move(slots), CpuPath::fused, SideStream::off, emakit::EmaOptions::default_staging_bytes,
                           f);
        UpdateKernel measured(std::move(copies), CpuPath::fused, SideStream::off,
                              emakit::EmaOptions::default_staging_bytes, f);
        UpdateKernel lerped(std::move(grouped), CpuPath::fused, SideStream::off,
                            emakit::EmaOptions::default_staging_bytes,
                            f == Arithmetic::lerp ? Arithmetic::subtract : Arithmetic::lerp);
        REQUIRE(plain.cpu_pass_only());
        REQUIRE(plain.arithmetic() == f);
        plain.average(k);
        measured.average(k, UpdateKernel::DriftMeasure::measure);  // the drift-summing loops write the same averages
        // update_together's group pass with a member of another arithmetic: each its own
        using Job = UpdateKernel::Job;
        const UpdateKernel::Work work[] = {{&measured, Job{UpdateKernel::Kind::average, k}},
                                           {&lerped, Job{UpdateKernel::Kind::average, k}}};
        UpdateKernel::TogetherScratch scratch;
        UpdateKernel::run_together(work, scratch);  // `measured` twice: the pass is a function of its input
        for (std::size_t i = 0; i < std::size(sizes); ++i) {
          INFO("tensor " << i << " of " << sizes[i] << " elements");
          const auto& got = plain.settled_slots()[i].average;
          CHECK(emakit::detail::bitwise_equal(got, want[i]));
          const auto twice = reference_average(f, want[i], plain.slots()[i].source, k);
          CHECK(emakit::detail::bitwise_equal(measured.settled_slots()[i].average, twice));
          CHECK(emakit::detail::bitwise_equal(
              lerped.settled_slots()[i].average,
              reference_average(lerped.arithmetic(), start[i], plain.slots()[i].source, k)));
          ++compared;
          not_lerp += f != Arithmetic::lerp ? 1 : 0;
          if (f != Arithmetic::lerp &&
              !emakit::detail::bitwise_equal(got,
                                             reference_average(Arithmetic::lerp, start[i], plain.slots()[i].source, k)))
            ++differs_from_lerp;
        }
      }
    }
  }
  CHECK(compared == pairs.size() * std::size(arithmetics) * std::size(decays) * std::size(sizes));
  // The formulas are not the lerp in disguise: most of the non-lerp updates round differently.
  CHECK(differs_from_lerp > not_lerp / 2);
}

TEST_CASE("The foreach path computes each Arithmetic with the peer's ATen ops", "[kernel]") {
  using emakit::Arithmetic;
  using emakit::detail::UpdateKernel;
  torch::manual_seed(12);
  // weighted_sum and subtract are ATen ops that each round once (mul by a scalar, add, sub): the
  // reference bitwise. The others are ATen's lerp and add or sub with alpha, which fuse on a CPU
  // capability with FMA and not on the baseline one: scaled_fused_add and fused_subtract bitwise
  // where ATen's add with alpha fuses (aten_add_alpha_fuses), else within one rounding of the
  // product (1/2 ulp at the operands' magnitude, max(|a|, |x|, |result|)) and one of the result
  // (1/2 ulp): 1 ulp. The lerps: LibTorch 1.13 has no _foreach_lerp_ and computes
  // (1 - w) a + w x with 1 - w rounded (aten_compat.hpp): 1/2 ulp more for that weight, 1/2 for
  // the second product: 2 ulps.
  const bool add_alpha_fuses = aten_add_alpha_fuses();
  std::size_t compared = 0, bitwise = 0;
  for (const Arithmetic f : emakit::all_arithmetics) {
    for (const double d : {0.999, 0.1, 0.7}) {
      for (const bool staged : {false, true}) {  // in place, or through the staging pool (bf16 -> fp32)
        INFO(emakit::arithmetic_name(f) << ", d " << d << (staged ? ", staged" : ", in place"));
        const emakit::detail::Weights k{1.0 - d, d};
        std::vector<emakit::detail::Slot> slots(2);
        std::vector<torch::Tensor> want, magnitude;
        for (std::size_t i = 0; i < slots.size(); ++i) {
          slots[i].name = "t" + std::to_string(i);
          const auto x = torch::randn({i == 0 ? 1000 + 13 : 7});
          slots[i].source = staged ? x.to(torch::kBFloat16) : x;
          slots[i].average = torch::randn({x.numel()});
          want.push_back(reference_average(f, slots[i].average, slots[i].source.to(torch::kFloat), k));
          magnitude.push_back(at::maximum(emakit_test::operand_magnitude(slots[i].average, slots[i].source),
                                          want.back().to(torch::kDouble).abs()));
        }
        const auto sources = std::vector<torch::Tensor>{slots[0].source.clone(), slots[1].source.clone()};
        UpdateKernel kernel(std::move(slots), CpuPath::foreach, SideStream::off,
                            emakit::EmaOptions::default_staging_bytes, f);
        REQUIRE(kernel.census().staged + kernel.census().lerp > 0);
        CHECK(kernel.census().staged == (staged ? 1u : 0u));
        kernel.average(k);
        for (std::size_t i = 0; i < want.size(); ++i) {
          const auto& got = kernel.settled_slots()[i].average;
          CHECK(torch::equal(kernel.slots()[i].source, sources[i]));  // the model is only read
          const bool fused_add = f == Arithmetic::scaled_fused_add || f == Arithmetic::fused_subtract;
          if (f == Arithmetic::weighted_sum || f == Arithmetic::subtract || (fused_add && add_alpha_fuses)) {
            CHECK(emakit::detail::bitwise_equal(got, want[i]));
            ++bitwise;
          } else {
            const double bound = fused_add ? 1.0 : 2.0;
            CHECK(emakit_test::max_ulps_at(got, want[i], magnitude[i], torch::kFloat) <= bound);
          }
          ++compared;
        }
      }
    }
  }
  CHECK(compared == std::size(emakit::all_arithmetics) * 3 * 2 * 2);
  CHECK(bitwise == (add_alpha_fuses ? 4u : 2u) * 3 * 2 * 2);
  if (!add_alpha_fuses)
    WARN("this CPU's ATen rounds the product of add with alpha: scaled_fused_add and fused_subtract "
         "checked within 1 ulp, not bitwise");
}

TEST_CASE("The fused pass equals ATen's lerp for every supported dtype pair", "[kernel]") {
  torch::manual_seed(0);
  // Bounds in ulps of the average's dtype at max(|a|, |x|) (helpers.hpp derives them): the pass
  // computes ATen's formula, 3 ulps from the exact lerp; the reference is the lerp in double
  // rounded once (1/2 ulp). fp32 averages: 3.5; with a double source also its rounding to fp32
  // on load, times w <= 1: 4. double averages (w exact): the pass and ATen's double lerp are each
  // 2 ulps from the exact lerp: 4. bf16/fp16 averages, computed in fp32 and rounded once: 1.
  // The slack 1e-6 ulps covers the double reference's own roundings (2^-28 fp32 ulps).
  struct Pair {
    torch::Dtype average, source;
    double ulps;
  };
  const Pair pairs[] = {{torch::kFloat, torch::kFloat, 3.5}, {torch::kFloat, torch::kBFloat16, 3.5},
                        {torch::kFloat, torch::kHalf, 3.5},  {torch::kDouble, torch::kDouble, 4},
                        {torch::kDouble, torch::kFloat, 4},  {torch::kBFloat16, torch::kBFloat16, 1},
                        {torch::kHalf, torch::kHalf, 1},     {torch::kFloat, torch::kDouble, 4}};
  std::map<std::string, double> worst;  // per dtype pair, reported below
  for (const auto& pair : pairs) {
    for (double w : {0.0, 1e-4, 0.3, 0.5, 0.9, 1.0}) {
      for (std::int64_t n :
           {std::int64_t{1}, std::int64_t{1000}, emakit::detail::UpdateKernel::chunk_elements * 3 + 17}) {
        INFO(c10::toString(pair.average) << " <- " << c10::toString(pair.source) << ", w " << w << ", n " << n);
        const auto a = torch::randn({n}).to(pair.average);
        const auto x = torch::randn({n}).to(pair.source);
        const auto got = kernel_lerp(a, x, w);
        const auto expected = a.to(torch::kDouble).lerp(x.to(torch::kDouble), w).to(pair.average);
        CHECK(got.scalar_type() == pair.average);
        const double ulps = emakit_test::max_ulps_at(got, expected, emakit_test::operand_magnitude(a, x), pair.average);
        CHECK(ulps <= pair.ulps + 1e-6);
        auto& w_pair = worst[std::string(c10::toString(pair.average)) + " <- " + c10::toString(pair.source)];
        w_pair = std::max(w_pair, ulps);
        if (w == 1.0 && pair.average == pair.source) CHECK(torch::equal(got, x));  // lerp(a, x, 1) is x exactly
        if (w == 0.0) CHECK(torch::equal(got, a));
      }
    }
  }
  std::string report;
  for (const auto& [name, ulps] : worst) report += fmt::format("{}: {:.3g}; ", name, ulps);
  WARN("worst distance from the double reference, in ulps at max(|a|, |x|): " << report);
  CHECK(worst.size() == std::size(pairs));
}

TEST_CASE("The fused pass matches ATen's own float lerp to 1.5 ulps of the inputs", "[kernel]") {
  // The same formula and roundings, except that ATen's vectorised loop may fuse w * d into the
  // sum (FMA): the product's rounding (1/2 ulp at max(|a|, |x|)) and each sum's (1/2) differ.
  torch::manual_seed(1);
  const auto a = torch::randn({100000});
  const auto x = torch::randn({100000});
  double worst = 0;
  for (double w : {1e-4, 0.25, 0.75}) {
    INFO("w " << w);
    const auto got = kernel_lerp(a, x, w);
    const auto aten = a.lerp(x, w);
    const double ulps = emakit_test::max_ulps_at(got, aten, emakit_test::operand_magnitude(a, x), torch::kFloat);
    CHECK(ulps <= 1.5);
    worst = std::max(worst, ulps);
  }
  WARN("fused pass against ATen's float lerp: at most " << worst << " ulps at max(|a|, |x|)");
}

TEST_CASE("The foreach path of other devices agrees with the fused pass", "[kernel]") {
  // On CUDA the kernel calls _foreach_lerp_ (LibTorch >= 2) or _foreach_mul_ + _foreach_add_
  // (1.13); the same ops run on CPU tensors here, so the device path is checked without a GPU.
  torch::manual_seed(4);
  INFO("foreach_lerp available: " << EMAKIT_HAS_FOREACH_LERP);
  double widest = 0;
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto a = torch::randn({5000});
    const auto x = torch::randn({5000}).to(dtype);  // bf16 source: staged into fp32 first
    for (double w : {1e-3, 0.6}) {
      INFO(c10::toString(dtype) << " source, w " << w);
      const auto fused = kernel_lerp(a, x, w, CpuPath::fused);
      const auto foreach = kernel_lerp(a, x, w, CpuPath::foreach);
      // Each is 3 fp32 ulps at max(|a|, |x|) from the exact lerp (ATen's formula, or 1.13's
      // mul + add; helpers.hpp): 6 apart at most, 3.5 from the double reference rounded once
      // (plus its double roundings, 1e-6).
      const auto magnitude = emakit_test::operand_magnitude(a, x);
      const auto reference = a.to(torch::kDouble).lerp(x.to(torch::kDouble), w).to(torch::kFloat);
      const double apart = emakit_test::max_ulps_at(fused, foreach, magnitude, torch::kFloat);
      CHECK(apart <= 6);
      CHECK(emakit_test::max_ulps_at(fused, reference, magnitude, torch::kFloat) <= 3.5 + 1e-6);
      CHECK(emakit_test::max_ulps_at(foreach, reference, magnitude, torch::kFloat) <= 3.5 + 1e-6);
      widest = std::max(widest, apart);
    }
  }
  WARN("fused and foreach paths: at most " << widest << " ulps apart (at max(|a|, |x|))");
  CHECK(torch::equal(kernel_lerp(torch::zeros({3}), torch::ones({3}), 1.0, CpuPath::foreach), torch::ones({3})));
}

TEST_CASE("Complex and non-contiguous sources take the slow paths and stay correct", "[kernel]") {
  torch::manual_seed(2);
  const auto ac = torch::randn({64}, torch::kComplexFloat);
  const auto xc = torch::randn({64}, torch::kComplexFloat);
  CHECK(torch::equal(kernel_lerp(ac, xc, 0.2), ac.lerp(xc, 0.2)));  // the slow path is ATen's lerp_ itself

  const auto a = torch::randn({5, 7});
  const auto x = torch::randn({7, 5}).t();  // non-contiguous
  REQUIRE_FALSE(x.is_contiguous());
  // ATen's formula both ways; ATen's vectorised loop may fuse the product into the sum: 1.5 ulps
  // at max(|a|, |x|) (as against ATen's float lerp above).
  CHECK(emakit_test::max_ulps_at(kernel_lerp(a, x, 0.3), a.lerp(x.contiguous(), 0.3),
                                 emakit_test::operand_magnitude(a, x), torch::kFloat) <= 1.5);
}

TEST_CASE("Many small tensors and one big one give the same result with 1 and all threads", "[kernel]") {
  torch::manual_seed(3);
  std::vector<emakit::SourceTensor> sources;
  for (int i = 0; i < 300; ++i) sources.push_back({"small" + std::to_string(i), torch::randn({1 + i % 37}), false});
  sources.push_back({"big", torch::randn({emakit::detail::UpdateKernel::chunk_elements * 5 + 3}), false});
  const int threads = at::get_num_threads();
  emakit::FixedEma one(sources, emakit::Fixed(0.9)), all(sources, emakit::Fixed(0.9));
  std::map<std::string, torch::Tensor> starts;
  for (auto& s : sources) {
    starts[s.name] = s.tensor.clone();
    s.tensor.add_(1.0);
  }
  at::set_num_threads(1);
  one.update();
  at::set_num_threads(threads);
  all.update();
  for (const auto& s : sources) {
    INFO(s.name);
    CHECK(torch::equal(one.average(s.name), all.average(s.name)));
    // lerp(s, fl(s + 1), 0.1) against fl(fl(s + 1) - 0.9): the pass is 3 ulps (at max(|s|, |s + 1|))
    // from the exact lerp, which is 0.9 * (the rounding of s + 1, 1/2 ulp) from fl(s + 1) - 0.9,
    // itself rounded once (1/2 ulp): 4 ulps.
    CHECK(emakit_test::max_ulps_at(one.average(s.name), s.tensor - 0.9,
                                   emakit_test::operand_magnitude(starts[s.name], s.tensor), torch::kFloat) <= 4);
  }
}

// ---- an update allocates nothing ----------------------------------------------------------

namespace {
// Counts tensor allocations on the CPU while installed.
struct CountingAllocator final : c10::Allocator {
  explicit CountingAllocator(c10::Allocator* inner) : inner(inner) {}
#if TORCH_VERSION_MAJOR >= 2 && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(std::size_t n) override {
    ++count;
    return inner->allocate(n);
  }
  void copy_data(void* dest, const void* src, std::size_t n) const override { default_copy_data(dest, src, n); }
#else
  c10::DataPtr allocate(std::size_t n) const override {
    ++count;
    return inner->allocate(n);
  }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return inner->raw_deleter(); }
  c10::Allocator* inner;
  mutable std::atomic<int> count{0};
};

struct InstallAllocator {
  explicit InstallAllocator(c10::Allocator* a) : previous(c10::GetCPUAllocator()) { c10::SetCPUAllocator(a, 200); }
  ~InstallAllocator() { c10::SetCPUAllocator(previous, 200); }
  c10::Allocator* previous;
};
}  // namespace

TEST_CASE("An update allocates no tensor memory, for fp32 and bf16 models", "[kernel][memory]") {
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    INFO(c10::toString(dtype));
    emakit_test::TinyNet model;
    emakit_test::cast_floats(*model, dtype);
    emakit::WarmupEma ema(*model);
    // Measuring the drift in the pass, and two EMAs updated together, allocate nothing either.
    emakit::WarmupEma drifting(*model, {}, {}, emakit::EmaOptions().drift_every(1));
    emakit::Ema<emakit::Fixed> fast(*model, emakit::Fixed(0.9)), slow(*model, emakit::Fixed(0.99));
    ema.update();  // first update: any lazy set-up happens here
    drifting.update();
    emakit::update_together(fast, slow);
    CountingAllocator counter(c10::GetCPUAllocator());
    {
      InstallAllocator installed(&counter);
      for (int i = 0; i < 10; ++i) {
        ema.update();
        CHECK(drifting.update().drift.has_value());
        emakit::update_together(fast, slow);
      }
      // The counter sees allocations: this one must be counted, or the test proves nothing.
      const int before = counter.count.load();
      auto probe = torch::empty({16});
      CHECK(counter.count.load() == before + 1);
    }
    CHECK(counter.count.load() == 1);  // only the probe
    CHECK(ema.num_updates() == 11);
    CHECK(drifting.num_updates() == 11);
    CHECK(slow.num_updates() == 11);
  }
}

// ---- the fused pass: conversions, partition, copies ---------------------------------------

TEST_CASE("The vectorised bf16 and fp16 widening equals c10's conversion for all 65536 inputs", "[kernel]") {
  int mismatches = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float half = emakit::detail::half_bits_to_float(bits);
    const float half_ref = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    const float bf16 = emakit::detail::bf16_bits_to_float(bits);
    const float bf16_ref = static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
    const bool half_ok = std::isnan(half_ref)
                             ? std::isnan(half)
                             : std::bit_cast<std::uint32_t>(half) == std::bit_cast<std::uint32_t>(half_ref);
    const bool bf16_ok = std::isnan(bf16_ref)
                             ? std::isnan(bf16)
                             : std::bit_cast<std::uint32_t>(bf16) == std::bit_cast<std::uint32_t>(bf16_ref);
    if (!half_ok || !bf16_ok) {
      if (++mismatches <= 5)
        INFO("bits " << b << ": fp16 " << half << " vs " << half_ref << ", bf16 " << bf16 << " vs " << bf16_ref);
      CHECK((half_ok && bf16_ok));
    }
  }
  CHECK(mismatches == 0);
}

namespace {
// Counts how often each element is visited: a segment function over int32 counters.
void count_visits(void* a, const void*, std::int64_t begin, std::int64_t end, emakit::detail::Weights,
                  double*) noexcept {
  for (std::int64_t i = begin; i < end; ++i) ++static_cast<std::int32_t*>(a)[i];
}
}  // namespace

TEST_CASE("The CPU pass splits its tensors into shares that cover every element exactly once", "[kernel]") {
  std::vector<std::vector<std::int32_t>> counters;
  emakit::detail::CpuPass pass;
  const std::int64_t sizes[] = {1, 15, 16, 17, 1000, 3, 65536 + 5, 0, 7, 100000};
  const std::int64_t costs[] = {12, 10, 8, 12, 6, 12, 10, 12, 24, 12};
  for (std::size_t k = 0; k < std::size(sizes); ++k) {
    counters.emplace_back(static_cast<std::size_t>(sizes[k]), 0);
    pass.add(&count_visits, k, sizes[k], costs[k]);
  }
  for (std::size_t k = 0, j = 0; k < std::size(sizes); ++k) {
    if (sizes[k] == 0) continue;  // empty tensors get no segment
    pass.segments()[j++].a = counters[k].data();
  }
  const std::int64_t total = pass.total_cost();
  for (std::int64_t shares : {1, 2, 3, 7, 64, 1000}) {
    INFO(shares << " shares");
    for (auto& c : counters) std::fill(c.begin(), c.end(), 0);
    for (std::int64_t t = 0; t < shares; ++t) pass.run_share(total * t / shares, total * (t + 1) / shares, {});
    for (std::size_t k = 0; k < counters.size(); ++k) {
      INFO("tensor " << k << " of " << sizes[k] << " elements");
      CHECK(std::all_of(counters[k].begin(), counters[k].end(), [](std::int32_t v) { return v == 1; }));
    }
  }
}

TEST_CASE("copy() makes every average equal to its source, for every dtype pair and layout", "[kernel]") {
  torch::manual_seed(5);
  struct Pair {
    torch::Dtype average, source;
  };
  const Pair pairs[] = {{torch::kFloat, torch::kFloat},  {torch::kFloat, torch::kBFloat16},
                        {torch::kFloat, torch::kHalf},   {torch::kDouble, torch::kFloat},
                        {torch::kFloat, torch::kDouble}, {torch::kBFloat16, torch::kBFloat16},
                        {torch::kLong, torch::kLong},    {torch::kComplexFloat, torch::kComplexFloat}};
  for (const auto& pair : pairs) {
    for (bool contiguous : {true, false}) {
      INFO(c10::toString(pair.average) << " <- " << c10::toString(pair.source) << (contiguous ? "" : ", transposed"));
      std::vector<emakit::detail::Slot> slots(2);
      auto source = (torch::randn({300, 7}) * 100).to(pair.source);
      if (!contiguous) source = source.t();
      slots[0].name = "averaged";
      slots[0].source = source;
      slots[0].average = torch::full(source.sizes(), std::nan(""), torch::kDouble).to(pair.average);
      slots[0].averaged = c10::isFloatingType(pair.source) || c10::isComplexType(pair.source);
      slots[1].name = "copied";
      slots[1].source = source;
      slots[1].average = torch::zeros(source.sizes()).to(pair.average);
      slots[1].averaged = false;
      emakit::detail::UpdateKernel kernel(std::move(slots));
      kernel.copy();
      for (const auto& s : kernel.settled_slots()) CHECK(torch::equal(s.average, s.source.to(pair.average)));
    }
  }
}

TEST_CASE("A model of every dtype averages with 1 and all threads like ATen, copying its integers", "[kernel]") {
  torch::manual_seed(6);
  std::vector<emakit::SourceTensor> sources;
  const torch::Dtype dtypes[] = {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble};
  for (int i = 0; i < 64; ++i) {
    const std::int64_t n = (i % 5 == 0) ? emakit::detail::UpdateKernel::chunk_elements + i : 1 + 37 * i;
    sources.push_back({"t" + std::to_string(i), torch::randn({n}).to(dtypes[i % 4]), false});
  }
  sources.push_back({"count", torch::tensor({7}, torch::kLong), true});
  const int threads = at::get_num_threads();
  for (int t : {1, threads}) {
    INFO(t << " threads");
    at::set_num_threads(t);
    emakit::FixedEma ema(sources, emakit::Fixed(0.75));
    std::vector<torch::Tensor> expected, starts;
    for (auto& s : sources) {
      const auto start = s.tensor.to(ema.average(s.name).scalar_type()).clone();
      starts.push_back(start);
      if (s.tensor.is_floating_point())
        s.tensor.add_(1.0);
      else
        s.tensor.add_(3);
      expected.push_back(s.tensor.is_floating_point() ? start.lerp(s.tensor.to(start.scalar_type()), 0.25)
                                                      : s.tensor.clone());
    }
    ema.update();
    for (std::size_t k = 0; k < sources.size(); ++k) {
      INFO(sources[k].name << " " << c10::toString(sources[k].tensor.scalar_type()));
      const auto& got = ema.average(sources[k].name);
      if (!got.is_floating_point()) {
        CHECK(torch::equal(got, expected[k]));
        continue;
      }
      // ATen's formula both ways, in the average's dtype (w = 0.25 exact); ATen's vectorised loop
      // may fuse the product into the sum: 1.5 ulps at max(|start|, |source|).
      CHECK(emakit_test::max_ulps_at(got, expected[k], emakit_test::operand_magnitude(starts[k], sources[k].tensor),
                                     got.scalar_type()) <= 1.5);
    }
  }
  at::set_num_threads(threads);
}

TEST_CASE("The side-stream option changes nothing for a CPU model", "[kernel]") {
  torch::manual_seed(7);
  emakit_test::TinyNet model;
  emakit::FixedEma plain(*model, emakit::Fixed(0.9));
  emakit::FixedEma side(*model, emakit::Fixed(0.9), {}, emakit::EmaOptions().side_stream(true));
  for (int i = 0; i < 3; ++i) {
    emakit_test::perturb(*model);
    plain.update();
    side.update();
    side.wait_for_model_reads();
  }
  for (const auto& item : plain.averages()) CHECK(torch::equal(item.value(), side.average(item.key())));
}

namespace {
// A source or average of `n` elements of `dtype` with the values a loop must round alike in every
// copy: normals of both signs and many magnitudes, zeros, subnormals, infinities and a NaN.
torch::Tensor awkward(std::int64_t n, c10::ScalarType dtype) {
  auto t = (torch::randn({n}, torch::kDouble) * torch::pow(2.0, torch::randint(-20, 20, {n}, torch::kDouble)));
  t.index_put_({0}, 0.0);
  t.index_put_({1}, -0.0);
  t.index_put_({2}, std::numeric_limits<double>::infinity());
  t.index_put_({3}, std::numeric_limits<double>::quiet_NaN());
  t.index_put_({4}, dtype == torch::kDouble ? 1e-310 : (dtype == torch::kHalf ? 1e-7 : 1e-40));  // subnormal
  return t.to(dtype);
}

// Bitwise equal where either holds a number, NaN where the other has NaN. Which NaN an operation
// on a NaN gives (its sign and payload) follows the operand order the compiler chose for that
// copy (x86 returns the first operand's NaN), not rounding: the copies agree on every number.
bool same_bits_any_nan(const torch::Tensor& got, const torch::Tensor& want) {
  const auto got_nan = torch::isnan(got), want_nan = torch::isnan(want);
  return torch::equal(got_nan, want_nan) &&
         emakit::detail::bitwise_equal(got.masked_fill(got_nan, 0), want.masked_fill(want_nan, 0));
}
}  // namespace

TEST_CASE("Every instruction set's copy of the segment loops rounds exactly like the baseline one", "[kernel]") {
  using emakit::Arithmetic;
  using emakit::detail::SegmentFn;
  using Fns = std::function<std::pair<SegmentFn, SegmentFn>(c10::ScalarType, c10::ScalarType, Arithmetic)>;
  // The baseline and each copy, for a fused pair and an arithmetic given at run time.
  const auto fns_of = [](auto pick) -> Fns {
    return [pick](c10::ScalarType a, c10::ScalarType s, Arithmetic f) {
      std::pair<SegmentFn, SegmentFn> out;
      emakit::detail::dispatch_pair(a, s, [&](auto* a_tag, auto* s_tag) {
        using A = std::remove_pointer_t<decltype(a_tag)>;
        using S = std::remove_const_t<std::remove_pointer_t<decltype(s_tag)>>;
        out = pick(static_cast<A*>(nullptr), static_cast<S*>(nullptr), f);
      });
      return out;
    };
  };
  const auto baseline = fns_of([](auto* a, auto* s, Arithmetic f) -> std::pair<SegmentFn, SegmentFn> {
    using A = std::remove_pointer_t<decltype(a)>;
    using S = std::remove_pointer_t<decltype(s)>;
    return {emakit::detail::average_segment_for<A, S>(f), &emakit::detail::copy_segment<A, S>};
  });
  std::vector<std::pair<std::string, Fns>> copies;
  std::string best = "baseline";
#if EMAKIT_AVX2_CLONES
  if (emakit::detail::use_avx2()) {
    copies.emplace_back(
        "AVX2", fns_of([](auto* a, auto* s, Arithmetic f) -> std::pair<SegmentFn, SegmentFn> {
          using A = std::remove_pointer_t<decltype(a)>;
          using S = std::remove_pointer_t<decltype(s)>;
          return {emakit::detail::average_segment_for_avx2<A, S>(f), &emakit::detail::copy_segment_avx2<A, S>};
        }));
    best = "AVX2";
  }
#endif
#if EMAKIT_AVX512_CLONES
  if (emakit::detail::use_avx512()) {
    copies.emplace_back(
        "AVX-512", fns_of([](auto* a, auto* s, Arithmetic f) -> std::pair<SegmentFn, SegmentFn> {
          using A = std::remove_pointer_t<decltype(a)>;
          using S = std::remove_pointer_t<decltype(s)>;
          return {emakit::detail::average_segment_for_avx512<A, S>(f), &emakit::detail::copy_segment_avx512<A, S>};
        }));
    best = "AVX-512";
  }
#endif
  const auto& arithmetics = emakit::all_arithmetics;
  // The plan takes the best copy this CPU runs, and the arithmetic's loop.
  for (const Arithmetic f : arithmetics) {
    INFO("best: " << best << ", " << emakit::arithmetic_name(f));
    const auto planned = emakit::detail::segment_fns<float, c10::BFloat16>(f);
    const auto expected = copies.empty() ? baseline(torch::kFloat, torch::kBFloat16, f)
                                         : copies.back().second(torch::kFloat, torch::kBFloat16, f);
    CHECK(planned == expected);
  }
  if (copies.empty()) EMAKIT_SKIP("no copy of the segment loops for another instruction set runs in this build here");

  torch::manual_seed(8);
  const std::int64_t n = 1000 + 13;  // vector bodies and scalar tails
  const std::vector<std::pair<c10::ScalarType, c10::ScalarType>> pairs = {
      {torch::kFloat, torch::kFloat},   {torch::kFloat, torch::kBFloat16}, {torch::kFloat, torch::kHalf},
      {torch::kDouble, torch::kDouble}, {torch::kDouble, torch::kFloat},   {torch::kBFloat16, torch::kBFloat16},
      {torch::kHalf, torch::kHalf}};
  std::size_t compared = 0;
  for (const auto& [name, fns] : copies) {
    for (const auto& [a_type, s_type] : pairs) {
      for (const Arithmetic f : arithmetics) {
        INFO(name << ": " << c10::toString(a_type) << " from " << c10::toString(s_type) << ", "
                  << emakit::arithmetic_name(f));
        const auto x = awkward(n, s_type);
        const auto [base_average, base_copy] = baseline(a_type, s_type, f);
        const auto [average, copy] = fns(a_type, s_type, f);
        for (const auto& [begin, end] : {std::pair<std::int64_t, std::int64_t>{0, n}, {3, n - 5}}) {
          // Both of the lerps' forms (|w| < 0.5 and not), and w = 1, which only the second computes.
          for (double w : {1e-3, 0.3, 0.7, 1.0}) {
            INFO("w " << w << ", elements [" << begin << ", " << end << ")");
            const emakit::detail::Weights k{w, 1.0 - w};
            const auto start = awkward(n, a_type);
            auto want = start.clone(), got = start.clone();
            base_average(want.data_ptr(), x.data_ptr(), begin, end, k, nullptr);
            average(got.data_ptr(), x.data_ptr(), begin, end, k, nullptr);
            CHECK(same_bits_any_nan(got, want));
            CHECK_FALSE(emakit::detail::bitwise_equal(got, start));  // the loop ran
            // Measuring the drift on the way writes the same averages; the sums of two copies differ
            // only in their order (the vector lanes), within 2 x (drift_chunk + 3) roundings.
            auto measured = start.clone(), base_measured = start.clone();
            double sums[2] = {0, 0}, base_sums[2] = {0, 0};
            average(measured.data_ptr(), x.data_ptr(), begin, end, k, sums);
            base_average(base_measured.data_ptr(), x.data_ptr(), begin, end, k, base_sums);
            CHECK(same_bits_any_nan(measured, want));
            CHECK(same_bits_any_nan(base_measured, want));
            const double u = std::ldexp(1.0, a_type == torch::kDouble ? -53 : -24);
            for (int j = 0; j < 2; ++j) {
              INFO("sum " << j << ": " << sums[j] << " and " << base_sums[j]);
              const bool both_nan = std::isnan(sums[j]) && std::isnan(base_sums[j]);
              CHECK((both_nan || sums[j] == base_sums[j] ||
                     std::abs(sums[j] - base_sums[j]) <=
                         2 * (emakit::detail::drift_chunk + 3) * u * std::abs(base_sums[j])));
            }
            ++compared;
          }
          if (f != Arithmetic::lerp) continue;  // the copy does not depend on the arithmetic
          const auto start = awkward(n, a_type);
          auto want = start.clone(), got = start.clone();
          base_copy(want.data_ptr(), x.data_ptr(), begin, end, {}, nullptr);
          copy(got.data_ptr(), x.data_ptr(), begin, end, {}, nullptr);
          CHECK(same_bits_any_nan(got, want));
          CHECK(same_bits_any_nan(got.slice(0, begin, end), x.slice(0, begin, end).to(a_type)));
          ++compared;
        }
      }
    }
  }
  CHECK(compared == copies.size() * pairs.size() * 2 * (4 * std::size(arithmetics) + 1));
}

namespace {
// The rest of the line `field` (e.g. "VmFlags:") of the mapping that holds `address`, from
// /proc/self/smaps; empty if there is none.
std::string smaps_field_at(const void* address, const std::string& field) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
      inside = a >= lo && a < hi;
    } else if (inside && line.rfind(field, 0) == 0) {
      return line.substr(field.size());
    }
  }
  return {};
}

std::string thp_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(in, mode);
  return mode;
}
}  // namespace

TEST_CASE("Large CPU averages are backed by huge pages where Linux allows it", "[kernel][memory]") {
  // The large average updates correctly whatever the machine: checked first, with REQUIRE, so
  // that the skip below (which ends the process as skipped under ctest) cannot hide a failure.
  std::vector<emakit::SourceTensor> sources{{"big", torch::randn({std::int64_t{1} << 22}), false},
                                            {"small", torch::randn({1000}), false}};
  emakit::FixedEma ema(sources, emakit::Fixed(0.5));
  const auto start = sources[0].tensor.clone();
  sources[0].tensor.add_(2.0);
  ema.update();
  // lerp(s, fl(s + 2), 0.5) against fl(fl(s + 2) - 1): the pass is 2 ulps at max(|s|, |s + 2|)
  // from the exact lerp (w = 0.5 exact), which is half the rounding of s + 2 (1/4 ulp) from
  // fl(s + 2) - 1, itself rounded once (1/2 ulp): 2.75 ulps.
  REQUIRE(emakit_test::max_ulps_at(ema.average("big"), sources[0].tensor - 1.0,
                                   emakit_test::operand_magnitude(start, sources[0].tensor), torch::kFloat) <= 2.75);

  const std::string mode = thp_mode();
  utsname u{};
  uname(&u);
  int major = 0, minor = 0;
  std::sscanf(u.release, "%d.%d", &major, &minor);
  const bool collapse = major > 6 || (major == 6 && minor >= 1);  // MADV_COLLAPSE
  if (mode.empty() || mode.find("[never]") != std::string::npos || !collapse)
    EMAKIT_SKIP("transparent huge pages off (\"" << mode << "\") or kernel " << u.release << " without MADV_COLLAPSE");
  const auto& big = ema.average("big");  // its 2 MiB-aligned interior is a mapping of its own
  const void* middle = static_cast<const char*>(big.data_ptr()) + big.nbytes() / 2;
  // What emakit decides: the interior is advised MADV_HUGEPAGE, which smaps shows as the VmFlags
  // flag "hg" of that mapping (deterministic). Whether the kernel then collapses it at once
  // (MADV_COLLAPSE) is best effort: it declines under memory pressure or fragmentation (seen here
  // once in four runs on a loaded machine), so the huge pages it holds are reported, not checked.
  const std::string flags = smaps_field_at(middle, "VmFlags:");
  INFO("VmFlags:" << flags);
  REQUIRE_FALSE(flags.empty());
  CHECK((" " + flags + " ").find(" hg ") != std::string::npos);
  const std::string huge = smaps_field_at(middle, "AnonHugePages:");
  WARN("the 16 MiB average's mapping holds AnonHugePages:" << huge << " (MADV_COLLAPSE is best effort)");
}

// ---- the foreach path (CUDA's), on CPU tensors ---------------------------------------------

namespace {

using emakit_test::census_of;
using emakit_test::OpCensus;

using emakit::detail::Slot;
using emakit::detail::UpdateKernel;

Slot make_slot(const std::string& name, const torch::Tensor& source, torch::Dtype average_dtype, bool averaged = true) {
  Slot s;
  s.name = name;
  s.source = source;
  s.average = torch::randn(source.sizes()).to(average_dtype).contiguous();
  if (!averaged) s.average = torch::zeros(source.sizes(), source.options());
  s.averaged = averaged;
  return s;
}

// What a lerp of `before` towards `x` gives in ATen, in the average's dtype (computed in double
// for half averages, which LibTorch 1.13's CPU lerp lacks).
torch::Tensor lerp_reference(const torch::Tensor& before, const torch::Tensor& x, double w) {
  if (before.scalar_type() == torch::kHalf || before.scalar_type() == torch::kBFloat16)
    return before.to(torch::kDouble).lerp(x.to(torch::kDouble), w).to(before.scalar_type());
  return before.lerp(x.to(before.scalar_type()), w);
}

// The update allocates no tensor: neither emakit (staging is planned once) nor, on LibTorch >= 2,
// the foreach ops it calls. LibTorch 1.13's CPU mul_/add_ with a scalar wrap it in a 0-d tensor
// on their slow path, which its CUDA fast path does not: there only emakit's own calls count.
void check_no_allocation(const OpCensus& ops) {
  CHECK(ops.own_allocations() == 0);
#if EMAKIT_HAS_FOREACH_LERP
  CHECK(ops.allocations() == 0);
#endif
}

// How far an average may be from lerp_reference, in ulps of its dtype at max(|before|, |x|)
// (helpers.hpp derives the parts). fp32/fp64 averages: the foreach path (ATen's formula, or
// 1.13's mul + add) and the reference (ATen's lerp in that dtype, on the same source rounded to
// it) are each 3 ulps from the exact lerp: 6. bf16/fp16 averages: the reference is the exact lerp
// rounded once (1/2 ulp); 1.13's mul and add each round to the dtype (1/2 + 1/2), the source
// staged into the dtype rounds (1/2, times w <= 1), plus fp32 ulps: under 3, on a grid of at most
// one ulp: 2. (_foreach_lerp_ rounds once: 1.)
double tolerance_ulps(torch::Dtype t) { return t == torch::kHalf || t == torch::kBFloat16 ? 2 : 6; }

}  // namespace

TEST_CASE("The foreach path: one lerp per (device, dtype), other dtypes through a bounded pool", "[kernel][foreach]") {
  torch::manual_seed(11);
  std::vector<std::pair<std::string, torch::Tensor>> model;
  for (int i = 0; i < 6; ++i) model.push_back({"f32_" + std::to_string(i), torch::randn({100 + 37 * i})});
  for (int i = 0; i < 5; ++i)
    model.push_back({"bf16_" + std::to_string(i), torch::randn({3, 70 + 11 * i}).to(torch::kBFloat16)});
  for (int i = 0; i < 2; ++i) model.push_back({"f64_" + std::to_string(i), torch::randn({50}).to(torch::kDouble)});
  model.push_back({"strided", torch::randn({9, 7}).t()});  // [7, 9], rows of 9 floats
  for (int i = 0; i < 2; ++i)
    model.push_back({"count_" + std::to_string(i), torch::randint(0, 100, {4}, torch::kLong)});
  std::int64_t staged_bytes = 0;  // fp32 bytes of what goes through the pool
  for (const auto& [name, t] : model)
    if (t.scalar_type() == torch::kBFloat16 || !t.is_contiguous()) staged_bytes += t.numel() * 4;
  const std::int64_t row_bytes = 9 * 4;

  for (std::int64_t bound : {std::int64_t{1}, std::int64_t{100}, std::int64_t{4096}, std::int64_t{1} << 30}) {
    INFO("staging bound " << bound << " bytes");
    std::vector<Slot> slots;
    for (const auto& [name, t] : model) {
      const bool integer = t.scalar_type() == torch::kLong;
      const auto dtype = t.scalar_type() == torch::kBFloat16 ? torch::kFloat : t.scalar_type();
      slots.push_back(make_slot(name, t, dtype, !integer));
    }
    UpdateKernel kernel(std::move(slots), UpdateKernel::CpuPath::foreach, SideStream::off, bound);
    const auto lists = kernel.census();
    CHECK(lists.lerp == 2);  // fp32 and fp64 sources read in place
    CHECK(lists.copy == 0);  // integer copies of a CPU average stay in the CPU pass
    // The bound holds (past it only for the strided source's 36-byte row), and a large bound
    // takes what the staged tensors need, not more than their size and alignment.
    CHECK(kernel.pool_bytes() <= std::max(bound, row_bytes));
    CHECK(kernel.pool_bytes() <= staged_bytes + 7 * UpdateKernel::staging_align * 4);
    if (bound >= staged_bytes + 7 * UpdateKernel::staging_align * 4) CHECK(lists.staged == 1);
    if (bound == 1) CHECK(lists.staged >= static_cast<std::size_t>(staged_bytes / row_bytes));

    std::vector<torch::Tensor> before;
    for (const auto& s : kernel.slots()) before.push_back(s.average.clone());
    for (auto& [name, t] : model) {
      if (t.is_floating_point()) {
        torch::NoGradGuard no_grad;
        t.add_(torch::randn(t.sizes()).to(t.scalar_type()));
      }
    }
    const double w = 0.3;
    const OpCensus ops = census_of([&] { kernel.average(w); });
    INFO(ops.str());
#if EMAKIT_HAS_FOREACH_LERP
    CHECK(ops["aten::_foreach_lerp_"] == static_cast<int>(lists.lerp + lists.staged));
#else
    CHECK(ops["aten::_foreach_mul_"] == static_cast<int>(lists.lerp + lists.staged));
    CHECK(ops["aten::_foreach_add_"] == static_cast<int>(lists.lerp + lists.staged));
#endif
#if EMAKIT_HAS_FOREACH_COPY
    CHECK(ops["aten::_foreach_copy_"] == static_cast<int>(lists.staged));
    CHECK(ops.total() == static_cast<int>(lists.lerp + 2 * lists.staged));  // nothing else, no copy per tensor
#endif
    check_no_allocation(ops);
    const auto& averaged = kernel.settled_slots();
    for (std::size_t i = 0; i < model.size(); ++i) {
      const auto& [name, t] = model[i];
      INFO(name);
      const auto& got = averaged[i].average;
      if (!t.is_floating_point()) {
        CHECK(torch::equal(got, t));
        continue;
      }
      const auto expected = lerp_reference(before[i], t, w);
#if EMAKIT_HAS_FOREACH_LERP
      CHECK(torch::equal(got, expected));  // the same ATen lerp, read through the pool or in place
#else
      // 1.13's mul + add against ATen's lerp: 3 ulps each from the exact lerp (tolerance_ulps).
      CHECK(emakit_test::max_ulps_at(got, expected, emakit_test::operand_magnitude(before[i], t), got.scalar_type()) <=
            tolerance_ulps(got.scalar_type()));
#endif
    }

    const OpCensus copies = census_of([&] { kernel.copy(); });
    INFO(copies.str());
#if EMAKIT_HAS_FOREACH_COPY
    CHECK(copies["aten::_foreach_copy_"] == static_cast<int>(lists.lerp + lists.staged));
#endif
    check_no_allocation(copies);
    const auto& copied = kernel.settled_slots();
    for (std::size_t i = 0; i < model.size(); ++i) {
      INFO(model[i].first);
      CHECK(torch::equal(copied[i].average, model[i].second.to(copied[i].average.scalar_type())));
    }
  }
}

TEST_CASE("The foreach path equals ATen's lerp for generated models and staging bounds", "[kernel][foreach]") {
  std::mt19937 rng(20261130);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  const torch::Dtype dtypes[] = {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble};
  const std::int64_t bounds[] = {1, 7, 64, 1000, 1 << 20};
  int staged_cases = 0, copied_tensors = 0;
  std::map<torch::Dtype, std::int64_t> averaged_elements;  // compared, per average dtype
  std::map<torch::Dtype, double> worst;                    // ulps, per average dtype
  for (int c = 0; c < 60; ++c) {
    torch::manual_seed(c);
    const std::int64_t bound = bounds[pick(5)];
    const int n = 1 + pick(12);
    std::vector<torch::Tensor> sources;
    std::vector<Slot> slots;
    std::int64_t largest_row = 0;
    std::string description;
    for (int i = 0; i < n; ++i) {
      const auto source_dtype = dtypes[pick(4)];
      torch::Tensor t;
      switch (pick(5)) {
        case 0: t = torch::randn({}); break;                                // 0-d
        case 1: t = torch::randn({1 + pick(300)}); break;                   // 1-d
        case 2: t = torch::randn({1 + pick(20), 1 + pick(20)}); break;      // 2-d
        case 3: t = torch::randn({1 + pick(20), 1 + pick(20)}).t(); break;  // strided
        default: t = torch::randn({pick(3), 5}); break;                     // maybe empty
      }
      t = t.to(source_dtype);
      // The average: the model's dtype, fp32 (the default for bf16/fp16), or another dtype.
      const auto average_dtype =
          pick(3) == 0 ? dtypes[pick(4)] : (source_dtype == torch::kDouble ? torch::kDouble : torch::kFloat);
      const bool averaged = pick(8) != 0;
      Slot s = make_slot("t" + std::to_string(i), t, averaged ? average_dtype : source_dtype, averaged);
      const bool staged = averaged && (!t.is_contiguous() || source_dtype != average_dtype);
      if (staged && !t.is_contiguous() && t.dim() > 0 && t.size(0) > 0)
        largest_row = std::max<std::int64_t>(largest_row, t.numel() / t.size(0) * c10::elementSize(average_dtype));
      description += fmt::format("{}{}{}->{} ", c10::toString(source_dtype), t.sizes(),
                                 t.is_contiguous() ? "" : "(strided)", c10::toString(average_dtype));
      sources.push_back(t);
      slots.push_back(std::move(s));
    }
    INFO("case " << c << ", bound " << bound << ": " << description);
    UpdateKernel kernel(std::move(slots), UpdateKernel::CpuPath::foreach, SideStream::off, bound);
    // One pool per average dtype at most, each within the bound (or the largest row, or one
    // element of its dtype, at least).
    CHECK(kernel.pool_bytes() <= 4 * std::max({bound, largest_row, std::int64_t{8}}));
    staged_cases += kernel.census().staged > 0 ? 1 : 0;
    std::vector<torch::Tensor> before;
    for (const auto& s : kernel.slots()) before.push_back(s.average.clone());
    for (auto& t : sources) {
      torch::NoGradGuard no_grad;
      t.copy_(torch::randn(t.sizes()).to(t.scalar_type()));
    }
    const double w = 0.05 + 0.9 * static_cast<double>(pick(100)) / 100.0;
    const OpCensus ops = census_of([&] { kernel.average(w); });
    check_no_allocation(ops);
    const auto& averaged = kernel.settled_slots();
    for (std::size_t i = 0; i < sources.size(); ++i) {
      const auto& s = averaged[i];
      INFO(s.name);
      if (!s.averaged) {
        CHECK(torch::equal(s.average, sources[i]));
        copied_tensors += 1;
        continue;
      }
      const auto expected = lerp_reference(before[i], sources[i], w);
      const auto dtype = s.average.scalar_type();
      const double ulps =
          emakit_test::max_ulps_at(s.average, expected, emakit_test::operand_magnitude(before[i], sources[i]), dtype);
      CHECK(ulps <= tolerance_ulps(dtype));
      averaged_elements[dtype] += s.average.numel();
      worst[dtype] = std::max(worst[dtype], ulps);
    }
  }
  // What ran: the generator reaches the pool, copies, and averages of every dtype.
  CHECK(staged_cases > 20);
  CHECK(copied_tensors > 0);
  std::string report;
  for (auto dtype : dtypes) {
    INFO(c10::toString(dtype) << " averages: " << averaged_elements[dtype] << " elements compared");
    CHECK(averaged_elements[dtype] > 0);
    report += fmt::format("{}: {} elements, worst {:.3g} ulps; ", c10::toString(dtype), averaged_elements[dtype],
                          worst[dtype]);
  }
  WARN(report);
}

TEST_CASE("skip_non_finite on the foreach path: one norm per (device, dtype) and one host sync", "[kernel][foreach]") {
  torch::manual_seed(12);
  std::vector<Slot> slots;
  for (int i = 0; i < 3; ++i) slots.push_back(make_slot("f32_" + std::to_string(i), torch::randn({64}), torch::kFloat));
  for (int i = 0; i < 3; ++i)
    slots.push_back(make_slot("bf16_" + std::to_string(i), torch::randn({64}).to(torch::kBFloat16), torch::kFloat));
  slots.push_back(make_slot("count", torch::randint(0, 5, {3}, torch::kLong), torch::kLong, false));
  Slot ignored = make_slot("ignored", torch::randn({8}), torch::kFloat, false);
  ignored.follows_averages = false;  // read only when an update copies
  slots.push_back(std::move(ignored));
  std::vector<torch::Tensor> sources;
  for (const auto& s : slots) sources.push_back(s.source);
  UpdateKernel kernel(std::move(slots), UpdateKernel::CpuPath::foreach);
  constexpr auto none = UpdateKernel::npos;

  std::size_t found = 0;
  const OpCensus ops = census_of([&] { found = kernel.first_non_finite(UpdateKernel::Kind::average); });
  INFO(ops.str());
  CHECK(found == none);
  CHECK(ops["aten::_foreach_norm"] == 2);               // fp32 and bf16 sources
  CHECK(ops.nested("aten::_local_scalar_dense") == 1);  // the one host sync

  torch::NoGradGuard no_grad;
  sources[7][3] = std::numeric_limits<float>::quiet_NaN();  // the ignored tensor: read only by copies
  CHECK(kernel.first_non_finite(UpdateKernel::Kind::average) == none);
  CHECK(kernel.first_non_finite(UpdateKernel::Kind::copy) == 7);
  sources[5][10] = std::numeric_limits<float>::quiet_NaN();
  sources[1][0] = std::numeric_limits<float>::infinity();
  const OpCensus found_ops =
      census_of([&] { CHECK(kernel.first_non_finite(UpdateKernel::Kind::average) == 1); });  // the first in model order
  INFO(found_ops.str());
  CHECK(found_ops["aten::_foreach_norm"] == 2);
  CHECK(found_ops.nested("aten::_local_scalar_dense") ==
        1);  // naming it reads the per-tensor flags: no sync per tensor
  sources[1][0] = 1.0f;
  CHECK(kernel.first_non_finite(UpdateKernel::Kind::average) == 5);
  sources[5][10] = -std::numeric_limits<float>::infinity();
  CHECK(kernel.first_non_finite(UpdateKernel::Kind::average) == 5);
  // Large finite values are finite: a max-abs norm cannot overflow.
  sources[5].fill_(3.0e38);
  sources[0].fill_(std::numeric_limits<float>::max());
  CHECK(kernel.first_non_finite(UpdateKernel::Kind::average) == none);
}

TEST_CASE("skip_non_finite on the fused CPU path dispatches nothing", "[kernel]") {
  std::vector<Slot> slots;
  for (int i = 0; i < 4; ++i)
    slots.push_back(make_slot("t" + std::to_string(i),
                              torch::randn({1000}).to(i % 2 ? torch::kBFloat16 : torch::kFloat), torch::kFloat));
  UpdateKernel kernel(std::move(slots));
  const OpCensus ops =
      census_of([&] { CHECK(kernel.first_non_finite(UpdateKernel::Kind::average) == UpdateKernel::npos); });
  INFO(ops.str());
  CHECK(ops.total() == 0);  // scanned by the host in place: no op, no sync, no allocation
}

TEST_CASE("A staging bound below one byte is an error naming the value", "[kernel][errors]") {
  CHECK_THROWS_WITH(emakit::EmaOptions().staging_bytes(0),
                    Catch::Contains("staging_bytes") && Catch::Contains("got 0"));
  CHECK_THROWS_WITH(UpdateKernel({}, UpdateKernel::CpuPath::foreach, SideStream::off, -5), Catch::Contains("got -5"));
}

// ---- waiting is a named call ---------------------------------------------------------------

TEST_CASE("slots() waits for nothing, settled_slots() settles once", "[kernel][sync]") {
  torch::manual_seed(12);
  std::vector<Slot> slots;
  for (int i = 0; i < 3; ++i)
    slots.push_back(make_slot("t" + std::to_string(i), torch::randn({10 + i}), torch::kFloat));
  UpdateKernel kernel(std::move(slots));
  auto& counts = emakit::detail::testing::sync_counts();
  const auto before = counts;
  kernel.average(0.5);
  for (std::size_t i = 0; i < kernel.size(); ++i) CHECK(kernel.slots()[i].average.defined());
  CHECK(counts.settles == before.settles);
  CHECK(counts.waits == before.waits);
  const auto& settled = kernel.settled_slots();
  CHECK(&settled == &kernel.slots());
  CHECK(counts.settles == before.settles + 1);
  CHECK(counts.waits == before.waits + 1);  // wait_for_update() orders the streams as wait_for_model_reads() does
}

TEST_CASE("Each read of an Ema settles once whatever its number of tensors, and update() not at all",
          "[kernel][sync]") {
  torch::manual_seed(13);
  emakit_test::TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.9));
  auto& counts = emakit::detail::testing::sync_counts();
  auto settles_of = [&](auto&& f) {
    const auto before = counts.settles;
    f();
    return counts.settles - before;
  };
  const auto names = ema.names(emakit::Role::average);
  REQUIRE(names.size() > 1);
  emakit_test::perturb(*model);
  CHECK(settles_of([&] { ema.update(); }) == 0);
  CHECK(settles_of([&] { (void)ema.averages(); }) == 1);
  CHECK(settles_of([&] { (void)ema.average(names.front()); }) == 1);
  CHECK(settles_of([&] { (void)ema.storage(); }) == 1);
  CHECK(settles_of([&] { (void)ema.names(emakit::Role::average); }) == 1);
  const auto state = ema.state_dict();
  CHECK(settles_of([&] { (void)ema.state_dict(); }) == 1);
  CHECK(settles_of([&] { ema.load_state_dict(state); }) == 1);
  emakit_test::TinyNet other;
  CHECK(settles_of([&] { ema.copy_to(*other); }) == 1);
  CHECK(settles_of([&] { ema.copy_from(*other); }) == 1);
  CHECK(settles_of([&] { auto guard = ema.swap_into(); }) == 1);
  CHECK(settles_of([&] { ema.wait_for_update(); }) == 1);
}

}  // namespace test_kernel
