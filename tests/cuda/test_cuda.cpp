// The update kernel on CUDA: foreach groups, mixed precision, CPU offload, Module::to().
#include <emakit/emakit.hpp>

#include "../helpers.hpp"

#include <catch2/catch.hpp>

namespace test_cuda {  // this file's names (unity batches: tests/CMakeLists.txt)

using emakit_test::TinyNet;

namespace {
// The same trajectory through a CUDA EMA and a CPU EMA of a CPU copy of the model.
void check_against_cpu(torch::Dtype model_dtype, emakit::EmaOptions options) {
  torch::manual_seed(0);
  TinyNet gpu_model, cpu_model;
  emakit_test::cast_floats(*gpu_model, model_dtype);
  gpu_model->to(torch::kCUDA);
  {
    torch::NoGradGuard no_grad;
    for (const auto& item : gpu_model->named_parameters())
      cpu_model->named_parameters()[item.key()].set_data(item.value().cpu());
    for (const auto& item : gpu_model->named_buffers())
      cpu_model->named_buffers()[item.key()].set_data(item.value().cpu());
  }
  emakit::WarmupEma gpu(*gpu_model, emakit::InversePowerWarmup(0.99), {}, options);
  emakit::WarmupEma cpu(*cpu_model, emakit::InversePowerWarmup(0.99));
  for (int i = 0; i < 20; ++i) {
    torch::NoGradGuard no_grad;
    for (const auto& item : gpu_model->named_parameters()) {
      const auto noise = torch::randn(item.value().sizes()).to(model_dtype);
      item.value().add_(noise.cuda());
      cpu_model->named_parameters()[item.key()].add_(noise);
    }
    gpu.update();
    cpu.update();
  }
  for (const auto& item : cpu.averages()) {
    INFO(item.key());
    const auto& g = gpu.average(item.key());
    CHECK(g.scalar_type() == item.value().scalar_type());
    CHECK(torch::allclose(g.cpu().to(torch::kDouble), item.value().to(torch::kDouble), 1e-5, 1e-6));
  }
}
}  // namespace

TEST_CASE("A CUDA model's EMA on the GPU equals the CPU EMA", "[cuda]") {
  check_against_cpu(torch::kFloat, emakit::EmaOptions());
}

TEST_CASE("A bf16 CUDA model gets an fp32 GPU average equal to the CPU one", "[cuda]") {
  check_against_cpu(torch::kBFloat16, emakit::EmaOptions());
}

TEST_CASE("CPU offload: a CUDA model's average kept on the CPU", "[cuda]") {
  check_against_cpu(torch::kFloat, emakit::EmaOptions().device(torch::kCPU));
}

TEST_CASE("After model->to(CUDA) the average stays on the CPU and follows the model", "[cuda]") {
  TinyNet model;
  emakit_test::fill_floats(*model, 1.0);
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  model->to(torch::kCUDA);
  emakit_test::fill_floats(*model, 3.0);
  ema.update();
  CHECK(ema.average("fc.weight").device().is_cpu());
  CHECK(torch::equal(ema.average("fc.weight"), torch::full({4, 3}, 2.0)));
  {
    auto swapped = ema.swap_into();
    CHECK(model->fc->weight.device().is_cuda());
    CHECK(torch::equal(model->fc->weight.cpu(), torch::full({4, 3}, 2.0)));
  }
  CHECK(torch::equal(model->fc->weight.cpu(), torch::full({4, 3}, 3.0)));
}

}  // namespace test_cuda
