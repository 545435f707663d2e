// The update kernel: the fused CPU pass against ATen's lerp for every dtype pair, chunking and
// threads, staging, and an update that allocates nothing.
#include <emakit/aliases.hpp>
#include <emakit/detail/kernel.hpp>

#include "helpers.hpp"

#include <ATen/Parallel.h>
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
#include <string>

#include <sys/utsname.h>

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

// ---- the fused pass: conversions, partition, copies ---------------------------------------

TEST_CASE("The vectorised bf16 and fp16 widening equals c10's conversion for all 65536 inputs", "[kernel]") {
  int mismatches = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float half = emakit::detail::half_bits_to_float(bits);
    const float half_ref = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    const float bf16 = emakit::detail::bf16_bits_to_float(bits);
    const float bf16_ref = static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
    const bool half_ok = std::isnan(half_ref) ? std::isnan(half) : std::bit_cast<std::uint32_t>(half) == std::bit_cast<std::uint32_t>(half_ref);
    const bool bf16_ok = std::isnan(bf16_ref) ? std::isnan(bf16) : std::bit_cast<std::uint32_t>(bf16) == std::bit_cast<std::uint32_t>(bf16_ref);
    if (!half_ok || !bf16_ok) {
      if (++mismatches <= 5) INFO("bits " << b << ": fp16 " << half << " vs " << half_ref << ", bf16 " << bf16 << " vs " << bf16_ref);
      CHECK((half_ok && bf16_ok));
    }
  }
  CHECK(mismatches == 0);
}

namespace {
// Counts how often each element is visited: a segment function over int32 counters.
void count_visits(void* a, const void*, std::int64_t begin, std::int64_t end, double) noexcept {
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
    for (std::int64_t t = 0; t < shares; ++t) pass.run_share(total * t / shares, total * (t + 1) / shares, 0.0);
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
  const Pair pairs[] = {{torch::kFloat, torch::kFloat},   {torch::kFloat, torch::kBFloat16}, {torch::kFloat, torch::kHalf},
                        {torch::kDouble, torch::kFloat},  {torch::kFloat, torch::kDouble},   {torch::kBFloat16, torch::kBFloat16},
                        {torch::kLong, torch::kLong},     {torch::kComplexFloat, torch::kComplexFloat}};
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
      for (const auto& s : kernel.slots()) CHECK(torch::equal(s.average, s.source.to(pair.average)));
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
    std::vector<torch::Tensor> expected;
    for (auto& s : sources) {
      const auto start = s.tensor.to(ema.average(s.name).scalar_type()).clone();
      if (s.tensor.is_floating_point()) s.tensor.add_(1.0);
      else s.tensor.add_(3);
      expected.push_back(s.tensor.is_floating_point() ? start.lerp(s.tensor.to(start.scalar_type()), 0.25) : s.tensor.clone());
    }
    ema.update();
    for (std::size_t k = 0; k < sources.size(); ++k) {
      INFO(sources[k].name << " " << c10::toString(sources[k].tensor.scalar_type()));
      CHECK(torch::allclose(ema.average(sources[k].name).to(torch::kDouble), expected[k].to(torch::kDouble), 1e-6, 1e-6));
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
    side.wait();
  }
  for (const auto& item : plain.averages()) CHECK(torch::equal(item.value(), side.average(item.key())));
}

TEST_CASE("The AVX2 copies of the segment loops round exactly like the baseline ones", "[kernel]") {
#if EMAKIT_AVX2_CLONES
  if (!emakit::detail::use_avx2()) {
    WARN("this CPU has no AVX2: only the baseline loops run");
    return;
  }
  torch::manual_seed(8);
  const std::int64_t n = 1000 + 13;
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    INFO(c10::toString(dtype));
    const auto x = torch::randn({n}).to(dtype);
    for (double w : {1e-3, 0.7}) {
      auto base = torch::randn({n});
      auto avx2 = base.clone();
      emakit::detail::dispatch_pair(torch::kFloat, dtype, [&](auto* a_tag, auto* s_tag) {
        using A = std::remove_pointer_t<decltype(a_tag)>;
        using S = std::remove_const_t<std::remove_pointer_t<decltype(s_tag)>>;
        emakit::detail::lerp_segment<A, S>(base.data_ptr(), x.data_ptr(), 0, n, w);
        emakit::detail::lerp_segment_avx2<A, S>(avx2.data_ptr(), x.data_ptr(), 0, n, w);
      });
      CHECK(torch::equal(base, avx2));
    }
  }
#else
  WARN("no AVX2 copies in this build (not x86-64, or the baseline already has AVX2)");
#endif
}

namespace {
// AnonHugePages (kB) of the mapping that holds `address`, from /proc/self/smaps; -1 if unknown.
long huge_kib_at(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
      inside = a >= lo && a < hi;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      return std::stol(line.substr(14));
    }
  }
  return -1;
}

std::string thp_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(in, mode);
  return mode;
}
}  // namespace

TEST_CASE("Large CPU averages are backed by huge pages where Linux allows it", "[kernel][memory]") {
  const std::string mode = thp_mode();
  utsname u{};
  uname(&u);
  int major = 0, minor = 0;
  std::sscanf(u.release, "%d.%d", &major, &minor);
  const bool collapse = major > 6 || (major == 6 && minor >= 1);  // MADV_COLLAPSE
  if (mode.empty() || mode.find("[never]") != std::string::npos || !collapse) {
    WARN("transparent huge pages off or kernel " << u.release << " without MADV_COLLAPSE: not checked");
    return;
  }
  std::vector<emakit::SourceTensor> sources{{"big", torch::randn({std::int64_t{1} << 22}), false},
                                            {"small", torch::randn({1000}), false}};
  emakit::FixedEma ema(sources, emakit::Fixed(0.5));
  const auto& big = ema.average("big");  // its 2 MiB-aligned interior is a mapping of its own now
  CHECK(huge_kib_at(static_cast<const char*>(big.data_ptr()) + big.nbytes() / 2) > 0);
  sources[0].tensor.add_(2.0);
  ema.update();
  CHECK(torch::allclose(ema.average("big"), sources[0].tensor - 1.0, 1e-6, 1e-6));
}
