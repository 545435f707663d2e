// The update kernel: the fused CPU pass against ATen's lerp for every dtype pair, chunking and
// threads, staging, and an update that allocates nothing.
#include <emakit/aliases.hpp>
#include <emakit/detail/kernel.hpp>

#include "helpers.hpp"

#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <new>

namespace {

// Averages `a` towards `x` with weight w through the kernel; returns the result.
using CpuPath = emakit::detail::UpdateKernel::CpuPath;

torch::Tensor kernel_lerp(const torch::Tensor& a, const torch::Tensor& x, double w, CpuPath path = CpuPath::fused) {
  std::vector<emakit::detail::Slot> slots(1);
  slots[0].name = "t";
  slots[0].average = a.clone();
  slots[0].source = x;
  emakit::detail::UpdateKernel kernel(std::move(slots), path);
  kernel.average(w);
  return kernel.slots()[0].average;
}

}  // namespace

TEST_CASE("The fused pass equals ATen's lerp for every supported dtype pair", "[kernel]") {
  torch::manual_seed(0);
  struct Pair {
    torch::Dtype average, source;
    double tolerance;
  };
  const Pair pairs[] = {{torch::kFloat, torch::kFloat, 1e-6},     {torch::kFloat, torch::kBFloat16, 1e-6},
                        {torch::kFloat, torch::kHalf, 1e-6},      {torch::kDouble, torch::kDouble, 1e-14},
                        {torch::kDouble, torch::kFloat, 1e-14},   {torch::kBFloat16, torch::kBFloat16, 1e-2},
                        {torch::kHalf, torch::kHalf, 1e-3},       {torch::kFloat, torch::kDouble, 1e-6}};
  for (const auto& pair : pairs) {
    for (double w : {0.0, 1e-4, 0.3, 0.5, 0.9, 1.0}) {
      for (std::int64_t n : {std::int64_t{1}, std::int64_t{1000}, emakit::detail::UpdateKernel::chunk_elements * 3 + 17}) {
        INFO(c10::toString(pair.average) << " <- " << c10::toString(pair.source) << ", w " << w << ", n " << n);
        const auto a = torch::randn({n}).to(pair.average);
        const auto x = torch::randn({n}).to(pair.source);
        const auto got = kernel_lerp(a, x, w);
        const auto expected = a.to(torch::kDouble).lerp(x.to(torch::kDouble), w).to(pair.average);
        CHECK(got.scalar_type() == pair.average);
        CHECK(torch::allclose(got.to(torch::kDouble), expected.to(torch::kDouble), pair.tolerance, pair.tolerance));
        if (w == 1.0 && pair.average == pair.source) CHECK(torch::equal(got, x));  // lerp(a, x, 1) is x exactly
        if (w == 0.0) CHECK(torch::equal(got, a));
      }
    }
  }
}

TEST_CASE("The fused pass matches ATen's own float lerp to an ulp of the inputs", "[kernel]") {
  torch::manual_seed(1);
  const auto a = torch::randn({100000});
  const auto x = torch::randn({100000});
  for (double w : {1e-4, 0.25, 0.75}) {
    const auto got = kernel_lerp(a, x, w);
    const auto aten = a.lerp(x, w);
    const auto ulp = torch::max(a.abs(), x.abs()) * std::numeric_limits<float>::epsilon();
    CHECK(((got - aten).abs() <= ulp).all().item<bool>());
  }
}

TEST_CASE("The foreach path of other devices agrees with the fused pass", "[kernel]") {
  // On CUDA the kernel calls _foreach_lerp_ (LibTorch >= 2) or _foreach_mul_ + _foreach_add_
  // (1.13); the same ops run on CPU tensors here, so the device path is checked without a GPU.
  torch::manual_seed(4);
  INFO("foreach_lerp available: " << EMAKIT_HAS_FOREACH_LERP);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto a = torch::randn({5000});
    const auto x = torch::randn({5000}).to(dtype);  // bf16 source: staged into fp32 first
    for (double w : {1e-3, 0.6}) {
      const auto fused = kernel_lerp(a, x, w, CpuPath::fused);
      const auto foreach = kernel_lerp(a, x, w, CpuPath::foreach);
      CHECK(torch::allclose(fused, foreach, 1e-5, 1e-6));
    }
  }
  CHECK(torch::equal(kernel_lerp(torch::zeros({3}), torch::ones({3}), 1.0, CpuPath::foreach), torch::ones({3})));
}

TEST_CASE("Complex and non-contiguous sources take the slow paths and stay correct", "[kernel]") {
  torch::manual_seed(2);
  const auto ac = torch::randn({64}, torch::kComplexFloat);
  const auto xc = torch::randn({64}, torch::kComplexFloat);
  CHECK(torch::allclose(kernel_lerp(ac, xc, 0.2), ac.lerp(xc, 0.2)));

  const auto a = torch::randn({5, 7});
  const auto x = torch::randn({7, 5}).t();  // non-contiguous
  REQUIRE_FALSE(x.is_contiguous());
  CHECK(torch::allclose(kernel_lerp(a, x, 0.3), a.lerp(x.contiguous(), 0.3), 1e-6, 1e-6));
}

TEST_CASE("Many small tensors and one big one give the same result with 1 and all threads", "[kernel]") {
  torch::manual_seed(3);
  std::vector<emakit::SourceTensor> sources;
  for (int i = 0; i < 300; ++i) sources.push_back({"small" + std::to_string(i), torch::randn({1 + i % 37}), false});
  sources.push_back({"big", torch::randn({emakit::detail::UpdateKernel::chunk_elements * 5 + 3}), false});
  const int threads = at::get_num_threads();
  emakit::FixedEma one(sources, emakit::Fixed(0.9)), all(sources, emakit::Fixed(0.9));
  for (auto& s : sources) s.tensor.add_(1.0);
  at::set_num_threads(1);
  one.update();
  at::set_num_threads(threads);
  all.update();
  for (const auto& s : sources) {
    INFO(s.name);
    CHECK(torch::equal(one.average(s.name), all.average(s.name)));
    CHECK(torch::allclose(one.average(s.name), s.tensor - 0.9, 1e-5, 1e-5));
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
    ema.update();  // first update: any lazy set-up happens here
    CountingAllocator counter(c10::GetCPUAllocator());
    {
      InstallAllocator installed(&counter);
      for (int i = 0; i < 10; ++i) ema.update();
      // The counter sees allocations: this one must be counted, or the test proves nothing.
      const int before = counter.count.load();
      auto probe = torch::empty({16});
      CHECK(counter.count.load() == before + 1);
    }
    CHECK(counter.count.load() == 1);  // only the probe
    CHECK(ema.num_updates() == 11);
  }
}
