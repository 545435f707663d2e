// The compile-time benchmark's trainer TU (benchmarks/compile_time.sh): a small trainer, built as
// variants of this one file so that they differ in the EMA lines only:
//   EMAKIT_CT_EMA=0  LibTorch only: the reference
//   EMAKIT_CT_EMA=1  plus one WarmupEma (a shipped alias) through the umbrella header <emakit/emakit.hpp>
//   EMAKIT_CT_EMA=2  the same through the three headers it uses (aliases, checkpoint, format)
//   EMAKIT_CT_EMA=3  plus EMAKIT_CT_OWN (1, 2 or 3) of the user's own aliases through the umbrella
//                    header: Ema<decay, StepSchedule, ModuleStorage<NetImpl>> with a decay policy
//                    written here (emakit ships none of them), each doing the same work as the
//                    WarmupEma of variant 1
// Variants 1 to 3 are built in each of emakit's modes: emakit::emakit (the default: this file plus
// the implementation file), emakit::compiled and emakit::header_only (all inline).
#if EMAKIT_CT_EMA == 1 || EMAKIT_CT_EMA == 3
#include <emakit/emakit.hpp>
#elif EMAKIT_CT_EMA == 2
#include <emakit/aliases.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/format.hpp>
#endif
#if EMAKIT_CT_EMA != 0
#include <fmt/core.h>
#endif
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

// Cloneable, so that ModuleStorage<NetImpl> can clone it; BatchNorm brings buffers (an int64 one too).
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(784, 128));
    bn = register_module("bn", torch::nn::BatchNorm1d(128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
};
TORCH_MODULE(Net);

#if EMAKIT_CT_EMA == 3
#ifndef EMAKIT_CT_OWN
#define EMAKIT_CT_OWN 1
#endif
// The user's own decay policies (emakit::DecayPolicy: copyable, decay(DecayInput) -> double in
// [0, 1]; a name and fields() give checkpoint config checks and printing).
struct LinearRamp {  // d grows linearly from `start` to `end` over `steps` optimizer steps
  static constexpr std::string_view name = "LinearRamp";
  double start = 0.9, end = 0.999, steps = 1000;
  double decay(const emakit::DecayInput& in) const {
    return start + (end - start) * std::min(1.0, static_cast<double>(in.step) / steps);
  }
  std::vector<emakit::Field> fields() const { return {{"start", start}, {"end", end}, {"steps", steps}}; }
  bool operator==(const LinearRamp&) const = default;
};
struct HalfLife {  // the average's half-life in optimizer steps, whatever the update interval
  static constexpr std::string_view name = "HalfLife";
  double steps = 500;
  double decay(const emakit::DecayInput& in) const {
    return std::exp2(-static_cast<double>(in.steps_since_last_update) / steps);
  }
  std::vector<emakit::Field> fields() const { return {{"steps", steps}}; }
  bool operator==(const HalfLife&) const = default;
};
struct CosineRamp {  // d goes from `start` to `end` along a half cosine over `steps` updates
  static constexpr std::string_view name = "CosineRamp";
  double start = 0.99, end = 0.9999, steps = 2000;
  double decay(const emakit::DecayInput& in) const {
    const double t = std::min(1.0, static_cast<double>(in.update) / steps);
    return end - (end - start) * 0.5 * (1.0 + std::cos(3.141592653589793 * t));
  }
  std::vector<emakit::Field> fields() const { return {{"start", start}, {"end", end}, {"steps", steps}}; }
  bool operator==(const CosineRamp&) const = default;
};
static_assert(emakit::DecayPolicy<LinearRamp> && emakit::DecayPolicy<HalfLife> && emakit::DecayPolicy<CosineRamp>);
template <class Decay>
using MyEma = emakit::Ema<Decay, emakit::StepSchedule, emakit::ModuleStorage<NetImpl>>;
#endif

// One EMA's share of the work, spread over the trainer as in variant 1: made, updated each step,
// swapped in, saved, loaded and printed.
#if EMAKIT_CT_EMA == 1 || EMAKIT_CT_EMA == 2
#define EMA_MAKE emakit::WarmupEma ema(*model);
#define EMA_UPDATE ema.update();
#define EMA_FINISH                  \
  { auto guard = ema.swap_into(); } \
  emakit::save(ema, "ema.pt");      \
  emakit::load(ema, "ema.pt");      \
  fmt::print("{}\n", ema);
#elif EMAKIT_CT_EMA == 3
#define OWN_MAKE(N, Decay) MyEma<Decay> ema##N(*model);
#define OWN_UPDATE(N) ema##N.update();
#define OWN_FINISH(N)                   \
  { auto guard = ema##N.swap_into(); }  \
  emakit::save(ema##N, "ema" #N ".pt"); \
  emakit::load(ema##N, "ema" #N ".pt"); \
  fmt::print("{}\n", ema##N);
#if EMAKIT_CT_OWN == 1
#define EMA_MAKE OWN_MAKE(1, LinearRamp)
#define EMA_UPDATE OWN_UPDATE(1)
#define EMA_FINISH OWN_FINISH(1)
#elif EMAKIT_CT_OWN == 2
#define EMA_MAKE OWN_MAKE(1, LinearRamp) OWN_MAKE(2, HalfLife)
#define EMA_UPDATE OWN_UPDATE(1) OWN_UPDATE(2)
#define EMA_FINISH OWN_FINISH(1) OWN_FINISH(2)
#elif EMAKIT_CT_OWN == 3
#define EMA_MAKE OWN_MAKE(1, LinearRamp) OWN_MAKE(2, HalfLife) OWN_MAKE(3, CosineRamp)
#define EMA_UPDATE OWN_UPDATE(1) OWN_UPDATE(2) OWN_UPDATE(3)
#define EMA_FINISH OWN_FINISH(1) OWN_FINISH(2) OWN_FINISH(3)
#else
#error "EMAKIT_CT_OWN must be 1, 2 or 3"
#endif
#else
#define EMA_MAKE
#define EMA_UPDATE
#define EMA_FINISH
#endif

int main() {
  Net model;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  EMA_MAKE
  for (int i = 0; i < 4; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({8, 784})), torch::randint(10, {8}));
    loss.backward();
    opt.step();
    EMA_UPDATE
  }
  EMA_FINISH
  torch::save(model, "model.pt");
  torch::load(model, "model.pt");
  std::cout << *model << '\n';
}
