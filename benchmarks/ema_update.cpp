// emakit_bench_ema_update: the EMA update against its roofline and LibTorch's own ops.
//
// Every case updates the same buffers: a model's parameters (fp32, or bf16 with an fp32 EMA) and
// the EMA's averages. Names are  <op>/<layout>/<precision>/<implementation>/threads:<n>:
//   op              average (ema = lerp(ema, model, w)) or copy (ema = model)
//   implementation  emakit        Ema::update() (the fused CPU pass; foreach ops on CUDA)
//                   emakit_drift  Ema::update() measuring the drift (average only): one EMA
//                                 with EmaOptions::drift_every(2) updated twice per iteration;
//                                 the time is the measuring update's, counter
//                                 drift_off_seconds the other one's, both on the same buffers
//                                 (report.py: drift on / off from these two)
//                   roofline_<isa>  (CPU) a plain fused loop over the same buffers, split evenly
//                                 over the threads, compiled for one instruction set (baseline,
//                                 avx2, avx512: those this CPU runs); report.py's roofline is the
//                                 fastest of them and of the aten_* cases of the row
//                   roofline      (CUDA) one device-to-device copy of the same bytes
//                   aten_lerp     Tensor::lerp_ per tensor (fp32)
//                   aten_mul_add  Tensor::mul_ + Tensor::add_ per tensor (the 30-line loop)
//                   aten_foreach  emakit's device path run on CPU tensors (_foreach_lerp_ on
//                                 LibTorch >= 2, _foreach_mul_ + _foreach_add_ on 1.13; fp32)
//                   aten_copy     Tensor::copy_ per tensor (copy)
// Counters: bytes (moved per update: 12 per fp32 element averaged, 10 from bf16, 8 / 6 copied),
// params, tensors. bytes_per_second is bytes / time.
// memory/<layout>/bf16/emakit: the resident memory one update adds (VmHWM after the update minus
// VmRSS before, /proc/self/clear_refs resetting the peak), as extra_rss_fraction of model + EMA.
// group<K>/<layout>/<precision>/<implementation>/threads:<n> (CPU): K EMAs of one model (decays
// 0.999, 0.9999, 0.99, 0.9), each averaging at every update:
//   emakit_together  emakit::update_together(the K EMAs): the model read once for all of them
//   emakit_apart     each EMA's update(), one after another
//   roofline_<isa>   a plain loop reading the model once and writing the K averages, block by
//                    block, split evenly over the threads, per instruction set: the fastest is
//                    the speed limit of one pass for K EMAs
// bytes: 4 + 8K per fp32 element (2 + 8K from bf16): what one pass for K must move.
// step/<mode>/mlp (CUDA): a synthetic training step (forward, backward, SGD step) with no EMA,
// the EMA updated inline, or updated on a side stream (EmaOptions::side_stream).
//
// Own flags (the rest go to Google Benchmark):
//   --emakit_device=cpu|cuda         (default cpu)
//   --emakit_layouts=a,b,...         (default: every layout up to large_256m on CPU; on CUDA
//                                     many_small,resnet50,vit_b16,llm1b)
//   --emakit_threads=1,all           (CPU; `all` is every CPU the process may run on)
//   --emakit_groups=1,2,4            (CPU) the group<K> cases to run (default: none)
//   --emakit_evict_mb=N              (CPU group cases) write N MB of other memory before each
//                                    timed update, untimed, so that a model smaller than the
//                                    last-level cache is read from memory, as after a training
//                                    step (default 0: the update runs on what the last one left)
//   --emakit_dump_layouts=FILE       write the layouts as JSON and exit
#include "layouts.hpp"
#include "plain_loops.hpp"

#include <emakit/emakit.hpp>

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using emakit_bench::group_roofline;
using emakit_bench::Layout;
using emakit_bench::plain_loop_for;
using emakit_bench::roofline;
using emakit_bench::roofline_isas;
using emakit_bench::Span;

enum class Precision { fp32, bf16 };
const char* name_of(Precision p) { return p == Precision::fp32 ? "fp32" : "bf16"; }
enum class Op { average, copy };
const char* name_of(Op o) { return o == Op::average ? "average" : "copy"; }

constexpr double kWeight = 1e-3;  // lerp weight (decay 0.999)

// ---- the buffers ---------------------------------------------------------------------------

// A model's tensors and two EMAs of it: one that averages at every update, one that copies.
struct Fixture {
  std::string key;
  Layout layout;
  Precision precision;
  c10::Device device{c10::kCPU};
  std::vector<emakit::SourceTensor> model;
  std::unique_ptr<emakit::FixedEma> averaging;
  std::unique_ptr<emakit::FixedEma> copying;
  std::unique_ptr<emakit::FixedEma> drifting;  // averaging, drift measured at every other update; built on first use
  std::unique_ptr<emakit::detail::UpdateKernel> foreach_kernel;  // fp32 only, built on first use
  at::Tensor flat_a, flat_b;                                     // CUDA roofline buffers, built on first use

  std::int64_t params() const { return layout.numel(); }
  std::int64_t source_bytes() const { return precision == Precision::fp32 ? 4 : 2; }
  std::int64_t bytes(Op op) const { return params() * (op == Op::average ? 8 + source_bytes() : 4 + source_bytes()); }

  emakit::FixedEma& ema(Op op) { return op == Op::average ? *averaging : *copying; }
  std::vector<at::Tensor> averages(Op op) {
    std::vector<at::Tensor> out;
    for (const auto& item : ema(op).averages()) out.push_back(item.value());
    return out;
  }
};

std::unique_ptr<Fixture> g_fixture;  // one at a time: the cases of one fixture run consecutively

// The K EMAs of a group case, over the fixture's model (made on first use, freed before it).
struct Group {
  std::vector<emakit::FixedEma> emas;
};
std::map<std::string, Group> g_groups;
std::int64_t g_evict_bytes = 0;  // --emakit_evict_mb

// Writes g_evict_bytes of a buffer of its own, so that the caches hold it instead of the model.
void evict_caches() {
  static std::vector<std::uint8_t> buffer;
  if (g_evict_bytes == 0) return;
  buffer.resize(static_cast<std::size_t>(g_evict_bytes));
  static std::uint8_t round = 0;
  ++round;
  for (std::size_t i = 0; i < buffer.size(); i += 64) buffer[i] = round;
  benchmark::DoNotOptimize(buffer.data());
  benchmark::ClobberMemory();
}

Fixture& fixture(const Layout& layout, Precision precision, c10::Device device) {
  const std::string key = layout.name + "/" + name_of(precision) + "/" + device.str();
  if (g_fixture && g_fixture->key == key) return *g_fixture;
  g_groups.clear();   // bound to the previous model
  g_fixture.reset();  // free the previous buffers first
  auto f = std::make_unique<Fixture>();
  f->key = key;
  f->layout = layout;
  f->precision = precision;
  f->device = device;
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  const auto dtype = precision == Precision::fp32 ? torch::kFloat : torch::kBFloat16;
  for (std::size_t i = 0; i < layout.shapes.size(); ++i) {
    auto t = torch::randn(layout.shapes[i], torch::TensorOptions().device(device)).to(dtype);
    f->model.push_back({"p" + std::to_string(i), t, false});
  }
  f->averaging = std::make_unique<emakit::FixedEma>(f->model, emakit::Fixed(1.0 - kWeight));
  f->copying = std::make_unique<emakit::FixedEma>(
      f->model, emakit::Fixed(1.0 - kWeight),
      emakit::StepSchedule().warmup(emakit::Warmup::copy_before_start).start_step(std::int64_t{1} << 62));
  g_fixture = std::move(f);
  return *g_fixture;
}

void synchronize(c10::Device device) {
  if (!device.is_cuda()) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.synchronizeStream(impl.getStream(device));
}

// ---- the roofline: a plain fused loop --------------------------------------------------------

std::vector<Span> spans(Fixture& f, Op op) {
  std::vector<Span> out;
  auto avg = f.averages(op);
  for (std::size_t i = 0; i < avg.size(); ++i)
    out.push_back({avg[i].data_ptr<float>(), f.model[i].tensor.data_ptr(), avg[i].numel()});
  return out;
}

Group& group(Fixture& f, int k) {
  const std::string key = f.key + "/" + std::to_string(k);
  auto it = g_groups.find(key);
  if (it != g_groups.end()) return it->second;
  g_groups.clear();  // one group at a time, as fixtures
  Group g;
  const double decays[] = {0.999, 0.9999, 0.99, 0.9};
  for (int i = 0; i < k; ++i) g.emas.emplace_back(f.model, emakit::Fixed(decays[i % 4]));
  return g_groups.emplace(key, std::move(g)).first->second;
}

void run_group(benchmark::State& state, const Layout& layout, Precision precision, int k, const std::string& impl,
               int threads) {
  at::set_num_threads(threads);
  Fixture& f = fixture(layout, precision, c10::Device(c10::kCPU));
  Group& g = group(f, k);
  torch::NoGradGuard no_grad;
  std::function<void()> step;
  if (impl == "emakit_together") {
    step = [&g] { emakit::update_together(std::span<emakit::FixedEma>(g.emas)); };
  } else if (impl == "emakit_apart") {
    step = [&g] {
      for (auto& e : g.emas) e.update();
    };
  } else if (impl.starts_with("roofline_")) {
    const std::string isa = impl.substr(std::string("roofline_").size());
    std::vector<std::vector<Span>> members;
    for (auto& e : g.emas) {
      std::vector<Span> m;
      std::size_t i = 0;
      for (const auto& item : e.averages()) {
        m.push_back({item.value().data_ptr<float>(), f.model[i].tensor.data_ptr(), item.value().numel()});
        ++i;
      }
      members.push_back(std::move(m));
    }
    const std::int64_t total = f.params();
    if (precision == Precision::fp32)
      step = [loop = plain_loop_for<float, true>(isa), members, total, threads] {
        group_roofline<float>(loop, members, total, threads, float(kWeight));
      };
    else
      step = [loop = plain_loop_for<std::uint16_t, true>(isa), members, total, threads] {
        group_roofline<std::uint16_t>(loop, members, total, threads, float(kWeight));
      };
  } else {
    state.SkipWithError(("unknown implementation " + impl).c_str());
    return;
  }
  step();  // warm
  for (auto _ : state) {
    if (g_evict_bytes != 0) {
      state.PauseTiming();
      evict_caches();
      state.ResumeTiming();
    }
    step();
  }
  const std::int64_t bytes = f.params() * (f.source_bytes() + 8 * k);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * bytes);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["params"] = static_cast<double>(f.params());
  state.counters["emas"] = k;
}

// ---- the cases -------------------------------------------------------------------------------

struct Case {
  Layout layout;
  Precision precision;
  Op op;
  std::string impl;
  int threads;
  c10::Device device{c10::kCPU};
};

void set_counters(benchmark::State& state, Fixture& f, Op op) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * f.bytes(op));
  state.counters["bytes"] = static_cast<double>(f.bytes(op));
  state.counters["params"] = static_cast<double>(f.params());
  state.counters["tensors"] = static_cast<double>(f.model.size());
}

// Drift on against off on the same buffers: an EMA measuring the drift at every other update
// (drift_every(2)), updated twice per iteration; the measuring update is the iteration's manual
// time, the other one the counter drift_off_seconds (seconds per update). Two EMAs, one measuring
// at every update and one never, would compare two allocations, and where a buffer lies matters
// more than the drift here: on a 2-vCPU guest the same _foreach_lerp_ took 20 to 26 ms on eight
// clones of one 64M fp32 tensor, each clone's time repeatable (2026-12-03).
void run_drift(benchmark::State& state, Fixture& f) {
  if (!f.drifting)
    f.drifting = std::make_unique<emakit::FixedEma>(f.model, emakit::Fixed(1.0 - kWeight), emakit::StepSchedule(),
                                                    emakit::EmaOptions().drift_every(2));
  auto& ema = *f.drifting;
  ema.update();  // warm: page faults, lazy set-up
  synchronize(f.device);
  double off_seconds = 0;
  std::int64_t measured = 0;
  for (auto _ : state) {
    double on = 0;
    for (int i = 0; i < 2; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto result = ema.update();
      synchronize(f.device);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (result.drift) {
        on += seconds;
        ++measured;
      } else {
        off_seconds += seconds;
      }
    }
    state.SetIterationTime(on);
  }
  if (measured != static_cast<std::int64_t>(state.iterations())) {
    state.SkipWithError(("the drift was measured by " + std::to_string(measured) + " of " +
                         std::to_string(2 * state.iterations()) + " updates, expected every other one")
                            .c_str());
    return;
  }
  state.counters["drift_off_seconds"] = off_seconds / static_cast<double>(state.iterations());
  set_counters(state, f, Op::average);
}

void run_case(benchmark::State& state, const Case& c) {
  at::set_num_threads(c.threads);
  Fixture& f = fixture(c.layout, c.precision, c.device);
  torch::NoGradGuard no_grad;
  std::function<void()> step;
  if (c.impl == "emakit") {
    auto& ema = f.ema(c.op);
    step = [&ema] { ema.update(); };
  } else if (c.impl == "emakit_drift") {
    run_drift(state, f);
    return;
  } else if (c.impl.starts_with("roofline_") && c.device.is_cpu()) {
    const std::string isa = c.impl.substr(std::string("roofline_").size());
    auto s = spans(f, c.op);
    const std::int64_t total = f.params();
    const int threads = c.threads;
    const auto bind = [&](auto loop) -> std::function<void()> {
      return [loop, s, total, threads] { roofline(loop, s, total, threads, float(kWeight)); };
    };
    if (c.precision == Precision::fp32)
      step = c.op == Op::average ? bind(plain_loop_for<float, true>(isa)) : bind(plain_loop_for<float, false>(isa));
    else
      step = c.op == Op::average ? bind(plain_loop_for<std::uint16_t, true>(isa))
                                 : bind(plain_loop_for<std::uint16_t, false>(isa));
  } else if (c.impl == "roofline") {  // CUDA: one device-to-device copy of the update's bytes
    if (!f.flat_a.defined()) {
      const std::int64_t n = (f.bytes(c.op) / 2 + 3) / 4;  // bytes read = bytes written
      f.flat_a = torch::empty({n}, torch::TensorOptions().device(f.device));
      f.flat_b = torch::zeros({n}, torch::TensorOptions().device(f.device));
    }
    step = [&f] { f.flat_a.copy_(f.flat_b); };
  } else if (c.impl == "aten_lerp") {
    auto avg = f.averages(c.op);
    step = [avg, &f] {
      for (std::size_t i = 0; i < avg.size(); ++i) avg[i].lerp_(f.model[i].tensor, kWeight);
    };
  } else if (c.impl == "aten_mul_add") {
    auto avg = f.averages(c.op);
    step = [avg, &f] {
      for (std::size_t i = 0; i < avg.size(); ++i) avg[i].mul_(1.0 - kWeight).add_(f.model[i].tensor, kWeight);
    };
  } else if (c.impl == "aten_foreach") {
    if (!f.foreach_kernel) f.foreach_kernel = emakit_bench::foreach_reference(f.model, f.averages(c.op));
    auto* kernel = f.foreach_kernel.get();
    step = [kernel] { kernel->average(kWeight); };
  } else if (c.impl == "aten_copy") {
    auto avg = f.averages(c.op);
    step = [avg, &f] {
      for (std::size_t i = 0; i < avg.size(); ++i) avg[i].copy_(f.model[i].tensor);
    };
  } else {
    state.SkipWithError(("unknown implementation " + c.impl).c_str());
    return;
  }
  step();  // warm: page faults, thread pool, lazy set-up
  synchronize(f.device);
  for (auto _ : state) {
    step();
    synchronize(f.device);
  }
  set_counters(state, f, c.op);
}

// ---- resident memory of one update ---------------------------------------------------------

std::int64_t status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::size_t len = std::strlen(field);
  while (std::getline(in, line))
    if (line.compare(0, len, field) == 0) return std::stoll(line.substr(len + 1));
  return -1;
}

bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

void run_memory(benchmark::State& state, const Case& c) {
  at::set_num_threads(c.threads);
  Fixture& f = fixture(c.layout, c.precision, c.device);
  auto& ema = f.ema(Op::average);
  ema.update();
  double extra = 0;
  for (auto _ : state) {
    if (!reset_peak_rss()) {
      state.SkipWithError("cannot write /proc/self/clear_refs to reset the peak RSS");
      return;
    }
    const std::int64_t before = status_kib("VmRSS:");
    ema.update();
    const std::int64_t peak = status_kib("VmHWM:");
    extra = std::max(extra, static_cast<double>(peak - before) * 1024.0);
  }
  const double resident = static_cast<double>(f.params()) * (4.0 + static_cast<double>(f.source_bytes()));
  state.counters["extra_rss_bytes"] = extra;
  state.counters["model_plus_ema_bytes"] = resident;
  state.counters["extra_rss_fraction"] = extra / resident;
  state.counters["params"] = static_cast<double>(f.params());
}

// ---- a synthetic training step (CUDA) -----------------------------------------------------

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int layers, int width) {
    for (int i = 0; i < layers; ++i)
      fcs.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& fc : fcs) x = torch::relu(fc->forward(x));
    return x;
  }
  std::vector<torch::nn::Linear> fcs;
};

void run_step(benchmark::State& state, const std::string& mode, c10::Device device) {
  g_fixture.reset();
  torch::manual_seed(0);
  auto model = std::make_shared<MlpImpl>(8, 4096);
  model->to(device);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-4));
  std::optional<emakit::FixedEma> ema;
  if (mode != "no_ema")
    ema.emplace(*model, emakit::Fixed(0.999), emakit::StepSchedule(),
                emakit::EmaOptions().side_stream(mode == "ema_side_stream"));
  const auto x = torch::randn({1024, 4096}, torch::TensorOptions().device(device));
  auto train_step = [&] {
    optimizer.zero_grad();
    model->forward(x).square().mean().backward();
    if (ema) ema->wait_for_model_reads();  // the optimizer step writes the weights the side stream may still read
    optimizer.step();
    if (ema) ema->update();
  };
  for (int i = 0; i < 3; ++i) train_step();
  if (ema) ema->wait_for_model_reads();
  synchronize(device);
  constexpr int steps = 20;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) train_step();
    if (ema) ema->wait_for_model_reads();
    synchronize(device);
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps);
  }
  state.counters["params"] = 8.0 * (4096.0 * 4096.0 + 4096.0);
}

// ---- registration ------------------------------------------------------------------------------

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

void dump_layouts(const std::string& path) {
  std::ofstream out(path);
  out << "{\n";
  const auto layouts = emakit_bench::all_layouts();
  for (std::size_t k = 0; k < layouts.size(); ++k) {
    const auto& l = layouts[k];
    out << "  \"" << l.name << "\": {\"description\": \"" << l.description << "\", \"params\": " << l.numel()
        << ", \"shapes\": [";
    for (std::size_t i = 0; i < l.shapes.size(); ++i) {
      out << (i ? ", " : "") << "[";
      for (std::size_t j = 0; j < l.shapes[i].size(); ++j) out << (j ? ", " : "") << l.shapes[i][j];
      out << "]";
    }
    out << "]}" << (k + 1 < layouts.size() ? "," : "") << "\n";
  }
  out << "}\n";
}

void register_cases(const std::vector<Layout>& layouts, const std::vector<int>& threads, c10::Device device,
                    const std::vector<int>& groups) {
  for (const auto& layout : layouts) {
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      for (int t : threads) {
        for (Op op : {Op::average, Op::copy}) {
          std::vector<std::string> impls = {"emakit"};
          if (op == Op::average) impls.push_back("emakit_drift");
          if (device.is_cpu()) {
            for (const auto& isa : roofline_isas()) impls.push_back("roofline_" + isa);
            if (op == Op::average && precision == Precision::fp32)
              impls.insert(impls.end(), {"aten_lerp", "aten_foreach"});
            if (op == Op::average) impls.push_back("aten_mul_add");
            if (op == Op::copy) impls.push_back("aten_copy");
          } else {
            impls.push_back("roofline");
            if (op == Op::copy) impls.push_back("aten_copy");
          }
          for (const auto& impl : impls) {
            const Case c{layout, precision, op, impl, t, device};
            const std::string name = std::string(name_of(op)) + "/" + layout.name + "/" + name_of(precision) + "/" +
                                     impl + "/threads:" + std::to_string(t);
            auto* b = benchmark::RegisterBenchmark(name.c_str(), [c](benchmark::State& s) { run_case(s, c); });
            b->Unit(benchmark::kMillisecond);
            if (impl == "emakit_drift")
              b->UseManualTime();  // the measuring update only (run_drift)
            else
              b->UseRealTime();
          }
        }
        if (device.is_cpu()) {
          for (int k : groups) {
            std::vector<std::string> group_impls = {"emakit_together", "emakit_apart"};
            for (const auto& isa : roofline_isas()) group_impls.push_back("roofline_" + isa);
            for (const auto& impl : group_impls) {
              const std::string name = "group" + std::to_string(k) + "/" + layout.name + "/" + name_of(precision) +
                                       "/" + impl + "/threads:" + std::to_string(t);
              const std::string i = impl;
              benchmark::RegisterBenchmark(
                  name.c_str(),
                  [layout, precision, k, i, t](benchmark::State& s) { run_group(s, layout, precision, k, i, t); })
                  ->Unit(benchmark::kMillisecond)
                  ->UseRealTime();
            }
          }
        }
        if (precision == Precision::bf16 && device.is_cpu()) {
          const Case c{layout, precision, Op::average, "emakit", t, device};
          const std::string name = "memory/" + layout.name + "/bf16/emakit/threads:" + std::to_string(t);
          benchmark::RegisterBenchmark(name.c_str(), [c](benchmark::State& s) { run_memory(s, c); })
              ->Iterations(3)
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
  if (device.is_cuda()) {
    for (const char* mode : {"no_ema", "ema_inline", "ema_side_stream"}) {
      const std::string m = mode;
      benchmark::RegisterBenchmark(("step/" + m + "/mlp8x4096/fp32").c_str(),
                                   [m, device](benchmark::State& s) { run_step(s, m, device); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = "cpu", layouts_arg, threads_arg = "1,all", groups_arg;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* flag) -> std::optional<std::string> {
      const std::string prefix = std::string(flag) + "=";
      if (arg.rfind(prefix, 0) == 0) return arg.substr(prefix.size());
      return std::nullopt;
    };
    if (auto v = value("--emakit_device")) {
      device_name = *v;
    } else if (auto v2 = value("--emakit_layouts")) {
      layouts_arg = *v2;
    } else if (auto v3 = value("--emakit_threads")) {
      threads_arg = *v3;
    } else if (auto v5 = value("--emakit_groups")) {
      groups_arg = *v5;
    } else if (auto v6 = value("--emakit_evict_mb")) {
      g_evict_bytes = std::stoll(*v6) << 20;
    } else if (auto v4 = value("--emakit_dump_layouts")) {
      dump_layouts(*v4);
      return 0;
    } else {
      rest.push_back(argv[i]);
    }
  }
  const bool cuda = device_name == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "emakit_bench_ema_update: --emakit_device=cuda but no CUDA device is available\n");
    return 77;
  }
  if (layouts_arg.empty())
    layouts_arg =
        cuda ? "many_small,resnet50,vit_b16,llm1b" : "many_small,large_16m,resnet50,large_64m,vit_b16,large_256m";
  std::vector<Layout> layouts;
  const auto known = emakit_bench::all_layouts();
  for (const auto& name : split(layouts_arg)) {
    auto it = std::find_if(known.begin(), known.end(), [&](const Layout& l) { return l.name == name; });
    if (it == known.end()) {
      std::fprintf(stderr, "emakit_bench_ema_update: unknown layout '%s'\n", name.c_str());
      return 2;
    }
    layouts.push_back(*it);
  }
  // "all": the CPUs this process may run on (LibTorch's default thread count can be lower:
  // Debian's LibTorch 1.13 starts with 1 on this machine).
#if defined(_OPENMP)
  const int all = omp_get_num_procs();
#else
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
  std::vector<int> threads;
  if (cuda) {
    threads = {all};
  } else {
    for (const auto& t : split(threads_arg)) {
      const int n = t == "all" ? all : std::stoi(t);
      if (std::find(threads.begin(), threads.end(), n) == threads.end()) threads.push_back(n);
    }
  }
  std::vector<int> groups;
  for (const auto& k : split(groups_arg)) {
    const int n = std::stoi(k);
    if (n < 1 || n > 4) {
      std::fprintf(stderr, "emakit_bench_ema_update: --emakit_groups takes 1 to 4 EMAs, got '%s'\n", k.c_str());
      return 2;
    }
    groups.push_back(n);
  }
  register_cases(layouts, threads, cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU), groups);
  benchmark::AddCustomContext("libtorch", TORCH_VERSION);
  benchmark::AddCustomContext("emakit_threads_all", std::to_string(all));
  benchmark::AddCustomContext("emakit_device", device_name);
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  g_groups.clear();
  g_fixture.reset();
  return 0;
}
