// The CUDA update paths of the kernel: the side stream and its events, CPU offload through
// pinned staging, and an update that allocates no device memory.
#include <emakit/emakit.hpp>

#include "../helpers.hpp"
#include "../op_census.hpp"
#include "expect.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <catch2/catch.hpp>

#if __has_include(<c10/core/CachingDeviceAllocator.h>)
#include <c10/core/CachingDeviceAllocator.h>
#define EMAKIT_TEST_DEVICE_ALLOCATOR_STATS 1
#else
#define EMAKIT_TEST_DEVICE_ALLOCATOR_STATS 0
#endif

#include <map>
#include <string>
#include <vector>

namespace test_cuda_streams {  // this file's names (unity batches: tests/CMakeLists.txt)

namespace {

const c10::Device cuda0(c10::kCUDA, 0);

// Named tensors of a model on CUDA: a few large ones (so that an update takes long enough for a
// missing wait to show) and small ones.
std::vector<emakit::SourceTensor> cuda_model(torch::Dtype dtype, std::int64_t big = std::int64_t{1} << 24) {
  torch::manual_seed(0);
  std::vector<emakit::SourceTensor> out;
  for (int i = 0; i < 3; ++i)
    out.push_back({"big" + std::to_string(i), torch::randn({big}, torch::kCUDA).to(dtype), false});
  for (int i = 0; i < 50; ++i)
    out.push_back({"small" + std::to_string(i), torch::randn({17 + i}, torch::kCUDA).to(dtype), false});
  return out;
}

// An optimizer step on the current stream.
void step(std::vector<emakit::SourceTensor>& model, double value) {
  torch::NoGradGuard no_grad;
  for (auto& t : model) t.tensor.mul_(0.5).add_(value);
}

[[maybe_unused]] void synchronize() {
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  impl.synchronizeStream(impl.getStream(cuda0));
}

}  // namespace

TEST_CASE("A side-stream update gives the same averages as an inline one", "[cuda][stream]") {
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    INFO(c10::toString(dtype));
    auto model = cuda_model(dtype);
    emakit::FixedEma inline_ema(model, emakit::Fixed(0.9));
    emakit::FixedEma side_ema(model, emakit::Fixed(0.9), {}, emakit::EmaOptions().side_stream(true));
    for (int i = 0; i < 5; ++i) {
      side_ema.wait_for_model_reads();  // before the optimizer step writes the model
      step(model, i);
      inline_ema.update();
      side_ema.update();
    }
    for (const auto& item : inline_ema.averages()) {
      INFO(item.key());
      CHECK(torch::equal(item.value(), side_ema.average(item.key())));  // average() waits by itself
    }
  }
}

TEST_CASE("wait() keeps the next optimizer step from changing what the side stream reads", "[cuda][stream]") {
  auto model = cuda_model(torch::kFloat, std::int64_t{1} << 26);
  emakit::FixedEma ema(model, emakit::Fixed(0.5), {}, emakit::EmaOptions().side_stream(true));
  step(model, 1.0);
  std::vector<torch::Tensor> expected;
  for (const auto& t : model) expected.push_back(ema.average(t.name).lerp(t.tensor, 0.5));
  ema.update();
  ema.wait_for_model_reads();
  step(model, 100.0);  // queued right behind the update: without the wait it would race with it
  for (std::size_t i = 0; i < model.size(); ++i) {
    INFO(model[i].name);
    CHECK(torch::equal(ema.average(model[i].name), expected[i]));
  }
}

TEST_CASE("Reads and swaps wait for a side-stream update", "[cuda][stream]") {
  auto model = cuda_model(torch::kFloat, std::int64_t{1} << 26);
  emakit::FixedEma ema(model, emakit::Fixed(0.5), {}, emakit::EmaOptions().side_stream(true));
  step(model, 2.0);
  const auto expected = ema.average("big0").lerp(model[0].tensor, 0.5).cpu();
  ema.update();
  CHECK(torch::equal(ema.averages()["big0"].cpu(), expected));
  ema.update();
  const auto twice = expected.lerp(model[0].tensor.cpu(), 0.5);
  CHECK(torch::equal(ema.state_dict()["average.big0"].cpu(), twice));
}

TEST_CASE("CPU offload stages a CUDA model in pinned memory, in the model's dtype", "[cuda][offload]") {
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    INFO(c10::toString(dtype));
    auto model = cuda_model(dtype, 1000);
    std::vector<emakit::detail::Slot> slots;
    for (const auto& t : model) {
      emakit::detail::Slot s;
      s.name = t.name;
      s.source = t.tensor;
      s.average = t.tensor.to(torch::kCPU, torch::kFloat);
      slots.push_back(std::move(s));
    }
    emakit::detail::UpdateKernel kernel(std::move(slots));
    for (const auto& s : kernel.slots()) {
      REQUIRE(s.staging.defined());
      CHECK(s.staging.is_pinned());
      CHECK(s.staging.scalar_type() == dtype);  // bf16 crosses PCIe as bf16
    }
    // Against the same arithmetic on the CPU.
    std::vector<torch::Tensor> before;
    for (const auto& s : kernel.slots()) before.push_back(s.average.clone());
    step(model, 4.0);
    kernel.average(0.25);
    const auto& averaged = kernel.settled_slots();
    for (std::size_t i = 0; i < model.size(); ++i) {
      const auto x = model[i].tensor.cpu().to(torch::kFloat);
      CHECK(torch::allclose(averaged[i].average, before[i].lerp(x, 0.25), 1e-6, 1e-6));
    }
  }
}

TEST_CASE("CPU offload with a side stream: the CPU pass runs off the caller's thread, reads join it",
          "[cuda][offload]") {
  auto model = cuda_model(torch::kBFloat16);
  emakit::FixedEma plain(model, emakit::Fixed(0.9), {}, emakit::EmaOptions().device(torch::kCPU));
  emakit::FixedEma async(model, emakit::Fixed(0.9), {}, emakit::EmaOptions().device(torch::kCPU).side_stream(true));
  for (int i = 0; i < 4; ++i) {
    async.wait_for_model_reads();  // orders the device-to-host copies before the step; the host pass may go on
    step(model, i);
    plain.update();
    async.update();
  }
  for (const auto& item : plain.averages()) {
    INFO(item.key());
    CHECK(item.value().device().is_cpu());
    CHECK(torch::equal(item.value(), async.average(item.key())));
  }
}

TEST_CASE("A CUDA update allocates no device memory", "[cuda][memory]") {
#if EMAKIT_TEST_DEVICE_ALLOCATOR_STATS
  for (bool side : {false, true}) {
    INFO("side stream " << side);
    auto model = cuda_model(torch::kBFloat16, 4096);
    emakit::FixedEma ema(model, emakit::Fixed(0.9), {}, emakit::EmaOptions().side_stream(side));
    ema.update();
    ema.wait_for_model_reads();
    synchronize();
    auto* allocator = c10::getDeviceAllocator(c10::kCUDA);
    const auto before = allocator->getDeviceStats(0).allocation[0].allocated;
    for (int i = 0; i < 5; ++i) {
      ema.wait_for_model_reads();
      step(model, i);
      ema.update();
    }
    ema.wait_for_model_reads();
    synchronize();
    // step() allocates nothing either (in-place ops with scalars): every allocation is the EMA's.
    CHECK(allocator->getDeviceStats(0).allocation[0].allocated == before);
  }
#else
  EMAKIT_CUDA_UNAVAILABLE(
      "this LibTorch has no device-generic allocator statistics (c10/core/CachingDeviceAllocator.h): "
      "the allocations of a CUDA update were not counted");
#endif
}

TEST_CASE("The CUDA path runs _foreach_lerp_ on LibTorch >= 2 and mul_ + add_ on 1.13", "[cuda]") {
  // 53 fp32 tensors averaged into fp32 on the same device: one (device, dtype) group, so one
  // foreach lerp (or one _foreach_mul_ and one _foreach_add_), and no op per tensor.
  INFO("EMAKIT_HAS_FOREACH_LERP = " << EMAKIT_HAS_FOREACH_LERP);
  auto model = cuda_model(torch::kFloat, 1000);
  emakit::FixedEma ema(model, emakit::Fixed(0.75));
  step(model, 1.0);
  std::vector<torch::Tensor> expected;
  for (const auto& t : model) expected.push_back(ema.average(t.name).lerp(t.tensor, 0.25));
  const emakit_test::OpCensus ops = emakit_test::census_of([&] { ema.update(); });  // ops[name]: those it called itself
  INFO("ops of one update: " << ops.str());
#if EMAKIT_HAS_FOREACH_LERP
  CHECK(ops["aten::_foreach_lerp_"] == 1);
  CHECK(ops["aten::_foreach_mul_"] == 0);
  CHECK(ops["aten::_foreach_add_"] == 0);
#else
  CHECK(ops["aten::_foreach_lerp_"] == 0);
  CHECK(ops["aten::_foreach_mul_"] == 1);
  CHECK(ops["aten::_foreach_add_"] == 1);
#endif
  for (const char* per_tensor : {"aten::lerp_", "aten::mul_", "aten::add_", "aten::copy_"}) {
    INFO(per_tensor);
    CHECK(ops[per_tensor] == 0);
  }
  for (std::size_t i = 0; i < model.size(); ++i) {
    INFO(model[i].name);
    CHECK(torch::allclose(ema.average(model[i].name), expected[i], 1e-6, 1e-6));
  }
}

#undef EMAKIT_TEST_DEVICE_ALLOCATOR_STATS

}  // namespace test_cuda_streams
