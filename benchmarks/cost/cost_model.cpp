// emakit_cost_model: every CPU update path, one case at a time, for a count that repeats exactly.
//
// benchmarks/cost/cost.py runs it under valgrind's cache simulation (callgrind --cache-sim=yes
// --simulate-wb=yes, one thread, the AVX2 copies: valgrind has no AVX-512) and turns the counts of
// each case into figures per element and per tensor; docs/performance.md ("What an update costs")
// says what they mean. Each case builds its buffers, runs two updates uncounted (the plan, the
// page faults, the first update's set-up; the caches then hold what an update leaves), then
// counts --updates more between two client requests and dumps them under the case's name.
// Only the cases run instrumented (--instr-atstart=no), each from empty simulated caches.
//
// Case names: <path>/<layout>/<precision>[/<variant>]:
//   ema            Ema::update() of one FixedEma (decay 0.999), lerp arithmetic
//   ema_<arith>    the same with EmaOptions::arithmetic(<arith>), fp32, large only
//   copy           an update that copies (before start_step, Warmup::copy_before_start)
//   drift          Ema::update() measuring the drift at every update (drift_every(1))
//   together<K>    update_together over K FixedEmas (decays 0.999, 0.9999, 0.99, 0.9, ...)
//   group<K>       EmaGroup::update() of the same K
//   apart<K>       each of the K EMAs' update(), one after another
//   posthoc        PostHocEma::update(), its two default profiles (no snapshot in the count)
//   plain          the benchmark's plain fused loop (benchmarks/plain_loops.hpp), the ISA emakit picks
//   plain_copy     its copy loop
//   plain_group<K> its group loop: the model read once, block by block, into K averages
//   aten_lerp      Tensor::lerp_ per tensor (fp32)
//   aten_foreach   the foreach ops ATen gives (_foreach_lerp_ on LibTorch >= 2, _foreach_mul_ +
//                  _foreach_add_ on 1.13), on CPU tensors (fp32)
// Layouts: large (one tensor of 2^20 elements, 4 MiB in fp32) and many_small (the benchmark's
// 2000 tensors, 1,104,000 elements): both at least four times cost.py's simulated last-level
// cache (1 MiB), so that its misses are memory traffic.
//
//   emakit_cost_model --list                   the cases, one per line: name elements tensors
//   emakit_cost_model [--cases=REGEX] [--updates=N]
//                                              run the cases (under valgrind: counted)
//   emakit_cost_model --time [--scale=N] [--repetitions=N]
//                                              time each update natively (seconds, the median of
//                                              N), large scaled to N x 2^20 elements (default 16),
//                                              for cost.py --calibrate
#include "../layouts.hpp"
#include "../plain_loops.hpp"

#include <emakit/emakit.hpp>
#include <emakit/posthoc.hpp>

#include <ATen/Parallel.h>
#include <torch/version.h>
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define EMAKIT_COST_COUNTED 1
#else  // no valgrind headers: the cases run, but nothing can count them (cost.py refuses the binary)
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#define CALLGRIND_TOGGLE_COLLECT
#define CALLGRIND_DUMP_STATS_AT(name) ((void)(name))
#define EMAKIT_COST_COUNTED 0
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <regex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr double kWeight = 1e-3;  // lerp weight (decay 0.999), as the benchmark's

enum class Precision { fp32, bf16 };

// A model's tensors and the averages' shapes.
struct Model {
  std::string layout;
  Precision precision = Precision::fp32;
  std::vector<emakit::SourceTensor> tensors;
  std::int64_t elements = 0;
};

// Values in [-0.5, 0.5) from a multiplicative hash of the index: cheap to make under valgrind
// (randn is not), the same in every run.
Model make_model(const emakit_bench::Layout& layout, Precision precision) {
  Model m;
  m.layout = layout.name;
  m.precision = precision;
  std::uint32_t index = 0;
  for (std::size_t i = 0; i < layout.shapes.size(); ++i) {
    auto t = torch::empty(layout.shapes[i], torch::kFloat);
    float* data = t.data_ptr<float>();
    for (std::int64_t j = 0; j < t.numel(); ++j, ++index)
      data[j] = static_cast<float>((index * 2654435761u) >> 8) / 16777216.0f - 0.5f;
    if (precision == Precision::bf16) t = t.to(torch::kBFloat16);
    m.elements += t.numel();
    m.tensors.push_back({"p" + std::to_string(i), t, false});
  }
  return m;
}

std::vector<emakit_bench::Span> spans_of(const Model& m, const emakit::FixedEma& ema) {
  std::vector<emakit_bench::Span> out;
  std::size_t i = 0;
  for (const auto& item : ema.averages()) {
    out.push_back({item.value().data_ptr<float>(), m.tensors[i].tensor.data_ptr(), item.value().numel()});
    ++i;
  }
  return out;
}

std::vector<at::Tensor> averages_of(const emakit::FixedEma& ema) {
  std::vector<at::Tensor> out;
  for (const auto& item : ema.averages()) out.push_back(item.value());
  return out;
}

// The ISA emakit's pass picks on this CPU, for the plain loops: the widest the benchmark has.
std::string isa() { return emakit_bench::roofline_isas().back(); }

// What a case keeps alive and runs: `step` is one update.
struct Prepared {
  std::unique_ptr<emakit::FixedEma> ema;
  std::vector<emakit::FixedEma> group_members;
  std::unique_ptr<emakit::EmaGroup> group;
  std::unique_ptr<emakit::PostHocEma> posthoc;
  std::unique_ptr<emakit::detail::UpdateKernel> kernel;
  std::function<void()> step;
};

struct Case {
  std::string name;
  const Model* model;
  std::function<void(const Model&, Prepared&)> prepare;
};

const double kDecays[] = {0.999, 0.9999, 0.99, 0.9};

emakit::FixedEma make_ema(const Model& m, double decay = 1.0 - kWeight, emakit::EmaOptions options = {}) {
  return emakit::FixedEma(m.tensors, emakit::Fixed(decay), emakit::StepSchedule(), std::move(options));
}

std::vector<emakit::FixedEma> make_group(const Model& m, int k) {
  std::vector<emakit::FixedEma> out;
  out.reserve(static_cast<std::size_t>(k));
  for (int i = 0; i < k; ++i) out.push_back(make_ema(m, kDecays[i % 4]));
  return out;
}

// The benchmark's plain loop (Average) or copy loop over the model and a fresh EMA's averages.
template <bool Average>
void plain_step(const Model& m, Prepared& p) {
  p.ema = std::make_unique<emakit::FixedEma>(make_ema(m));
  const auto spans = spans_of(m, *p.ema);
  const auto total = m.elements;
  if (m.precision == Precision::fp32)
    p.step = [loop = emakit_bench::plain_loop_for<float, Average>(isa()), spans, total] {
      emakit_bench::roofline<float>(loop, spans, total, 1, float(kWeight));
    };
  else
    p.step = [loop = emakit_bench::plain_loop_for<std::uint16_t, Average>(isa()), spans, total] {
      emakit_bench::roofline<std::uint16_t>(loop, spans, total, 1, float(kWeight));
    };
}

std::filesystem::path g_posthoc_folder;

std::vector<Case> all_cases(const std::vector<Model>& models) {
  std::vector<Case> cases;
  const auto add = [&](const Model& m, const std::string& path, std::function<void(const Model&, Prepared&)> p) {
    const std::string precision = m.precision == Precision::fp32 ? "fp32" : "bf16";
    cases.push_back({path + "/" + m.layout + "/" + precision, &m, std::move(p)});
  };
  for (const Model& m : models) {
    const bool fp32 = m.precision == Precision::fp32;
    add(m, "ema", [](const Model& m, Prepared& p) {
      p.ema = std::make_unique<emakit::FixedEma>(make_ema(m));
      p.step = [e = p.ema.get()] { e->update(); };
    });
    if (fp32 && m.layout == "large") {
      for (const auto a : emakit::all_arithmetics) {
        if (a == emakit::Arithmetic::lerp) continue;  // the ema case
        add(m, std::string("ema_") + emakit::arithmetic_name(a), [a](const Model& m, Prepared& p) {
          p.ema = std::make_unique<emakit::FixedEma>(make_ema(m, 1.0 - kWeight, emakit::EmaOptions().arithmetic(a)));
          p.step = [e = p.ema.get()] { e->update(); };
        });
      }
    }
    add(m, "copy", [](const Model& m, Prepared& p) {
      p.ema = std::make_unique<emakit::FixedEma>(
          m.tensors, emakit::Fixed(1.0 - kWeight),
          emakit::StepSchedule().warmup(emakit::Warmup::copy_before_start).start_step(std::int64_t{1} << 62));
      p.step = [e = p.ema.get()] { e->update(); };
    });
    add(m, "drift", [](const Model& m, Prepared& p) {
      p.ema = std::make_unique<emakit::FixedEma>(make_ema(m, 1.0 - kWeight, emakit::EmaOptions().drift_every(1)));
      p.step = [e = p.ema.get()] {
        if (!e->update().drift) throw std::runtime_error("drift case: the update did not measure the drift");
      };
    });
    add(m, "plain", plain_step<true>);
    add(m, "plain_copy", plain_step<false>);
    if (!fp32) continue;
    for (int k : {1, 2, 4, 8}) {
      const std::string ks = std::to_string(k);
      add(m, "together" + ks, [k](const Model& m, Prepared& p) {
        p.group_members = make_group(m, k);
        p.step = [&p] { emakit::update_together(std::span<emakit::FixedEma>(p.group_members)); };
      });
      add(m, "group" + ks, [k](const Model& m, Prepared& p) {
        p.group_members = make_group(m, k);
        p.group = std::make_unique<emakit::EmaGroup>(std::span<emakit::FixedEma>(p.group_members));
        p.step = [g = p.group.get()] { g->update(); };
      });
      add(m, "apart" + ks, [k](const Model& m, Prepared& p) {
        p.group_members = make_group(m, k);
        p.step = [&p] {
          for (auto& e : p.group_members) e.update();
        };
      });
      add(m, "plain_group" + ks, [k](const Model& m, Prepared& p) {
        p.group_members = make_group(m, k);
        std::vector<std::vector<emakit_bench::Span>> members;
        for (const auto& e : p.group_members) members.push_back(spans_of(m, e));
        p.step = [loop = emakit_bench::plain_loop_for<float, true>(isa()), members, total = m.elements] {
          emakit_bench::group_roofline<float>(loop, members, total, 1, float(kWeight));
        };
      });
    }
    add(m, "posthoc", [](const Model& m, Prepared& p) {
      p.posthoc = std::make_unique<emakit::PostHocEma>(
          m.tensors, emakit::PostHocOptions(g_posthoc_folder / m.layout).snapshot_every(0));
      p.step = [e = p.posthoc.get()] { e->update(); };
    });
    add(m, "aten_lerp", [](const Model& m, Prepared& p) {
      p.ema = std::make_unique<emakit::FixedEma>(make_ema(m));
      p.step = [avg = averages_of(*p.ema), &m] {
        for (std::size_t i = 0; i < avg.size(); ++i) avg[i].lerp_(m.tensors[i].tensor, kWeight);
      };
    });
    add(m, "aten_foreach", [](const Model& m, Prepared& p) {
      p.ema = std::make_unique<emakit::FixedEma>(make_ema(m));
      p.kernel = emakit_bench::foreach_reference(m.tensors, averages_of(*p.ema));
      p.step = [k = p.kernel.get()] { k->average(kWeight); };
    });
  }
  return cases;
}

std::string_view flag_value(std::string_view arg, std::string_view name) {
  return arg.starts_with(name) ? arg.substr(name.size()) : std::string_view{};
}

int parse_count(std::string_view text, const char* flag) {
  const int n = std::atoi(std::string(text).c_str());
  if (n < 1 || std::to_string(n) != text) {
    std::fprintf(stderr, "emakit_cost_model: %s takes a whole number >= 1, got '%.*s'\n", flag,
                 static_cast<int>(text.size()), text.data());
    std::exit(2);
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  bool list = false, time = false;
  std::string pattern = ".*";
  int updates = 2, scale = 16, repetitions = 15;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--list") {
      list = true;
    } else if (a == "--time") {
      time = true;
    } else if (a.starts_with("--cases=")) {
      pattern = std::string(flag_value(a, "--cases="));
    } else if (a.starts_with("--updates=")) {
      updates = parse_count(flag_value(a, "--updates="), "--updates");
    } else if (a.starts_with("--scale=")) {
      scale = parse_count(flag_value(a, "--scale="), "--scale");
    } else if (a.starts_with("--repetitions=")) {
      repetitions = parse_count(flag_value(a, "--repetitions="), "--repetitions");
    } else {
      std::fprintf(stderr,
                   "emakit_cost_model: unknown argument '%s' (known: --list, --cases=REGEX, --updates=N, --time, "
                   "--scale=N, --repetitions=N)\n",
                   argv[i]);
      return 2;
    }
  }
  at::set_num_threads(1);  // one thread: the counts of one pass, in the order it runs
  torch::NoGradGuard no_grad;
  const std::int64_t large = (std::int64_t{1} << 20) * (time ? scale : 1);
  std::vector<Model> models;
  for (const auto precision : {Precision::fp32, Precision::bf16}) {
    models.push_back(make_model(emakit_bench::large(large, "large"), precision));
    models.push_back(make_model(emakit_bench::many_small(), precision));
  }
  const auto folder = std::filesystem::temp_directory_path() /
                      ("emakit-cost-" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  g_posthoc_folder = folder;
  const auto cases = all_cases(models);
  const std::regex selected(pattern);
  int status = 0;
#if defined(__clang__)
  const char* compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
  const char* compiler = "g++ " __VERSION__;
#else
  const char* compiler = "unknown";
#endif
  // What the counts depend on, for cost.py's budget key (the build is CMake's, see CMakeLists.txt).
  std::printf("# emakit_cost_model libtorch=%s compiler=%s isa=%s build=%s updates=%d counted=%d\n", TORCH_VERSION,
              compiler, isa().c_str(), EMAKIT_COST_BUILD, updates, EMAKIT_COST_COUNTED);
  for (const auto& c : cases) {
    if (!std::regex_search(c.name, selected)) continue;
    if (list) {
      std::printf("%s %lld %zu\n", c.name.c_str(), static_cast<long long>(c.model->elements), c.model->tensors.size());
      continue;
    }
    try {
      Prepared p;
      c.prepare(*c.model, p);
      // Under callgrind --instr-atstart=no: only the case runs instrumented, from empty simulated
      // caches, so that a case counts the same whichever cases run before it.
      CALLGRIND_START_INSTRUMENTATION;
      p.step();  // the plan, page faults, the first update's set-up
      p.step();  // the caches as an update leaves them
      if (time) {
        std::vector<double> seconds;
        for (int r = 0; r < repetitions; ++r) {
          const auto t0 = std::chrono::steady_clock::now();
          p.step();
          seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::nth_element(seconds.begin(), seconds.begin() + repetitions / 2, seconds.end());
        std::printf("time %s %lld %zu %.9g\n", c.name.c_str(), static_cast<long long>(c.model->elements),
                    c.model->tensors.size(), seconds[static_cast<std::size_t>(repetitions / 2)]);
      } else {
        CALLGRIND_TOGGLE_COLLECT;
        for (int r = 0; r < updates; ++r) p.step();
        CALLGRIND_TOGGLE_COLLECT;
        CALLGRIND_DUMP_STATS_AT(c.name.c_str());
        CALLGRIND_STOP_INSTRUMENTATION;
        std::printf("case %s %lld %zu %d\n", c.name.c_str(), static_cast<long long>(c.model->elements),
                    c.model->tensors.size(), updates);
      }
      std::fflush(stdout);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "emakit_cost_model: case %s failed: %s\n", c.name.c_str(), e.what());
      status = 1;
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(folder, ignored);
  return status;
}
