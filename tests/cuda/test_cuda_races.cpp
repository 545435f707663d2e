// The side-stream protocol on a real device (issue 15), each race provoked: the device's current
// stream is first kept busy (matrix products), so that the optimizer step and the side stream's
// update (which waits for the step through its `ready` event) are both still pending when the
// host goes on; the test then does at once what a trainer does right after update() (evaluate
// the EMA module, run the next forward, gather a sharded EMA, take the next optimizer step) and
// checks what it reads against the average computed on its own on the CPU, in double. A missing
// wait shows as stale or half-updated values. A round whose current stream was already idle at
// the read did not provoke its race (a WARN says so); each test counts, per race, the rounds that
// did, and fails on a CUDA device when no round provoked one: such a test would have tested nothing.
//
// Also here: the GPU memory an EMA holds per parameter (a `BYTES_PER_PARAM <label> <value>` line
// per precision on stdout, which benchmarks/gpu_check.sh copies into its summary), an update
// that allocates nothing after the first, and skip_non_finite on CUDA.
//
// Built with -DEMAKIT_RACE_TESTS_ON_CPU=1 (by hand, outside CMake), the same cases run on the CPU,
// where streams, offload and the allocator checks do nothing: a check of the tests' own
// arithmetic on a machine without a GPU.
#include <emakit/emakit.hpp>
#include <emakit/sharded.hpp>

#include "../helpers.hpp"
#include "expect.hpp"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <catch2/catch.hpp>
#include <torch/cuda.h>
#include <torch/nn/modules/container/sequential.h>

// A one-rank process group: Gloo where its headers are (Debian's libgloo-dev; the PyPI wheel
// ships none), else a bare c10d::ProcessGroup, which is enough for a world of one (ShardedStorage
// then runs no collective).
#if __has_include(<gloo/algorithm.h>) && defined(USE_C10D_GLOO) && !defined(EMAKIT_RACE_TESTS_NO_GLOO)
#include <emakit/gloo.hpp>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#define EMAKIT_RACE_TESTS_GLOO 1
#else
#define EMAKIT_RACE_TESTS_GLOO 0
#endif

#if __has_include(<c10/core/CachingDeviceAllocator.h>)
#include <c10/core/CachingDeviceAllocator.h>
#define EMAKIT_RACE_TESTS_ALLOCATOR_STATS 1
#else
#define EMAKIT_RACE_TESTS_ALLOCATOR_STATS 0
#endif

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace test_cuda_races {  // this file's names (unity batches: tests/CMakeLists.txt)

namespace {

#if defined(EMAKIT_RACE_TESTS_ON_CPU) && EMAKIT_RACE_TESTS_ON_CPU
const c10::Device dev(c10::kCPU);
#else
const c10::Device dev(c10::kCUDA, 0);
#endif

torch::TensorOptions on_dev() { return torch::TensorOptions().device(dev); }

void device_sync() {
  if (dev.is_cuda()) torch::cuda::synchronize();
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Keeps the current stream busy: matrix products queued on it (about `ms` of them, from a measured
// one), then an event. Whatever is queued after them on that stream, or on a stream that waits for
// it, is held until they end. running(): they had not ended yet when asked.
class Busy {
 public:
  Busy() {
    if (!dev.is_cuda()) return;
    a_ = torch::randn({4096, 4096}, on_dev());
    c_ = torch::empty_like(a_);
    at::mm_out(c_, a_, a_);
    device_sync();
    const auto t0 = Clock::now();
    for (int k = 0; k < 5; ++k) at::mm_out(c_, a_, a_);
    device_sync();
    ms_per_product_ = std::max(1e-3, ms_since(t0) / 5);
  }
  void queue(double ms) {
    if (!dev.is_cuda()) return;
    const int n = std::clamp(static_cast<int>(std::ceil(ms / ms_per_product_)), 1, 400);
    for (int k = 0; k < n; ++k) at::mm_out(c_, a_, a_);
    end_.record(c10::impl::VirtualGuardImpl(dev.type()).getStream(dev));
  }
  bool running() const { return dev.is_cuda() && !end_.query(); }

 private:
  at::Tensor a_, c_;
  double ms_per_product_ = 1;
  c10::Event end_{dev.type()};
};

// Per race (named by the read that would see stale values), the rounds run and the rounds that
// provoked it: the current stream was still busy, so the update had not run, when the read came.
// require_each() fails (on a CUDA device) for a race that no round provoked: the rounds passed
// without testing the wait. On the CPU (EMAKIT_RACE_TESTS_ON_CPU) nothing is ever pending.
class Provocations {
 public:
  void record(bool held, const std::string& what) {
    Count& c = counts_[what];
    c.rounds += 1;
    c.held += held ? 1 : 0;
    if (dev.is_cuda() && !held)
      WARN("the current stream had finished its busy work before " << what << ": this round did not provoke the race");
  }
  void require_each() const {
    REQUIRE(!counts_.empty());
    for (const auto& [what, c] : counts_) {
      std::cout << fmt::format("PROVOKED {}/{} rounds: {}\n", c.held, c.rounds, what) << std::flush;
      if (!dev.is_cuda()) continue;
      INFO(c.held << " of " << c.rounds << " rounds provoked the race at " << what
                  << " (0: the busy work ended before the read every time, so nothing was tested)");
      CHECK(c.held > 0);
    }
  }

 private:
  struct Count {
    int rounds = 0, held = 0;
  };
  std::map<std::string, Count> counts_;
};

// An optimizer step on the current stream: t = t/2 + value for every tensor, in two foreach calls.
void step(const std::vector<at::Tensor>& ts, double value) {
  torch::NoGradGuard no_grad;
  at::_foreach_mul_(ts, 0.5);
  at::_foreach_add_(ts, value);
}

// The tensors end to end in one new tensor (dtype: each converted to it; else they share one),
// read on the current stream in a few launches.
at::Tensor flat_copy(const std::vector<at::Tensor>& ts, std::optional<c10::ScalarType> dtype = std::nullopt) {
  std::vector<at::Tensor> parts;
  parts.reserve(ts.size());
  for (const auto& t : ts) {
    const at::Tensor flat = t.detach().reshape({-1});
    parts.push_back(dtype ? flat.to(*dtype) : flat);
  }
  return torch::cat(parts);
}

at::Tensor as_double(const at::Tensor& t) { return t.detach().to(torch::kCPU, torch::kDouble); }

// before + w (src - before), in double on the CPU.
at::Tensor lerp_expected(const at::Tensor& before, const at::Tensor& src, double w) {
  const at::Tensor a = as_double(before);
  return a + w * (as_double(src) - a);
}

// Elements of `got` farther than tol (relative, and absolute near 0) from `expected`; NaN counts.
std::int64_t bad_elements(const at::Tensor& got, const at::Tensor& expected, double tol = 1e-5) {
  const at::Tensor g = as_double(got), e = as_double(expected);
  REQUIRE(g.sizes() == e.sizes());
  return torch::logical_not((g - e).abs() <= tol * (e.abs() + 1.0)).sum().item<std::int64_t>();
}
// Elements of `got` that still hold (within tol) the average from before the update, for messages.
std::int64_t stale_elements(const at::Tensor& got, const at::Tensor& before, double tol = 1e-6) {
  const at::Tensor g = as_double(got), b = as_double(before);
  return ((g - b).abs() <= tol * (b.abs() + 1.0)).sum().item<std::int64_t>();
}

std::vector<at::Tensor> in_order(const emakit::StateDict& d, const std::vector<std::string>& names) {
  std::vector<at::Tensor> out;
  out.reserve(names.size());
  for (const auto& n : names) out.push_back(d[n]);
  return out;
}

std::vector<std::string> param_names(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

// A side-stream update made of many small steps: with a staging pool of 128 KiB, a bf16 model's
// update into an fp32 average is dozens of copy + lerp pairs on the side stream, so that it still
// runs well after the moment a reader that skipped the wait would read.
emakit::EmaOptions long_side_stream() { return emakit::EmaOptions().side_stream(true).staging_bytes(128 << 10); }

// `layers` Linear(64, 64) in bf16 on the device.
torch::nn::Sequential linear_stack(int layers) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < layers; ++i) seq->push_back(torch::nn::Linear(64, 64));
  seq->to(dev, torch::kBFloat16);
  return seq;
}

// `count` parameters p0, p1, ... of about `numel` elements each, in `dtype` on the device.
struct ParamBagImpl : torch::nn::Module {
  ParamBagImpl(int count, std::int64_t numel, torch::Dtype dtype) {
    for (int i = 0; i < count; ++i)
      register_parameter(fmt::format("p{}", i), torch::randn({numel + i % 7}, on_dev()).to(dtype));
  }
};
TORCH_MODULE(ParamBag);

// A bf16 model whose forward pass runs a BatchNorm1d(64) first (in train mode it writes its running
// statistics and num_batches_tracked in place), then `layers` Linear(64, 64).
struct BnNetImpl : torch::nn::Module {
  explicit BnNetImpl(int layers) {
    bn = register_module("bn", torch::nn::BatchNorm1d(64));
    for (int i = 0; i < layers; ++i) fcs.push_back(register_module(fmt::format("fc{}", i), torch::nn::Linear(64, 64)));
    to(dev);
    emakit_test::cast_floats(*this, torch::kBFloat16);  // num_batches_tracked stays int64
  }
  at::Tensor forward(at::Tensor x) {
    x = bn->forward(x.to(torch::kBFloat16));
    for (auto& fc : fcs) x = fc->forward(x);
    return x;
  }
  torch::nn::BatchNorm1d bn{nullptr};
  std::vector<torch::nn::Linear> fcs;
};
TORCH_MODULE(BnNet);

// The same round for module() and TeacherStudent::teacher(): `read` returns the EMA module's
// parameters right after update(), as a forward pass of the teacher would.
template <class EmaT, class Update, class Read>
void module_read_rounds(torch::nn::Sequential& seq, EmaT& ema, Update update, Read read) {
  Busy busy;
  Provocations provoked;
  const auto names = param_names(*seq);
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    const at::Tensor before = as_double(flat_copy(in_order(ema.averages(), names)));
    busy.queue(100);
    step(seq->parameters(), round + 1.0);  // the optimizer step, held behind the busy work
    const at::Tensor src = flat_copy(seq->parameters());
    const emakit::UpdateResult r = update();
    REQUIRE(r.action == emakit::Action::averaged);
    const at::Tensor got = flat_copy(read());  // right after update(): no wait() in between
    const bool held = busy.running();
    const at::Tensor expected = lerp_expected(before, src, 1.0 - r.decay);
    provoked.record(held, "the read");
    INFO("elements still holding the previous average: " << stale_elements(got, before) << " of " << got.numel());
    CHECK(bad_elements(got, expected) == 0);
  }
  provoked.require_each();
}

// A one-rank process group (see the top of this file).
struct OneRankGroup {
  emakit_test::TempDir dir;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  OneRankGroup() {
#if EMAKIT_RACE_TESTS_GLOO
    auto store = c10::make_intrusive<c10d::FileStore>((dir.path / "store").string(), 1);
    group = emakit::make_gloo_group(store, 0, 1, std::chrono::seconds(60));
#else
    group = c10::make_intrusive<c10d::ProcessGroup>(0, 1);
#endif
  }
};

// Counts, while alive, the _foreach_norm calls and the host syncs (_local_scalar_dense: item(),
// is_nonzero(), equal() ...) that any thread dispatches. Device-to-host copies are not counted.
class OpCensus {
 public:
  OpCensus() {
    norms() = 0;
    syncs() = 0;
    handle_ =
        at::addGlobalCallback(at::RecordFunctionCallback(&OpCensus::on_start).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCensus() { at::removeCallback(handle_); }
  OpCensus(const OpCensus&) = delete;
  OpCensus& operator=(const OpCensus&) = delete;
  static int norm_calls() { return norms().load(); }
  static int host_syncs() { return syncs().load(); }

 private:
  static std::atomic<int>& norms() {
    static std::atomic<int> n{0};
    return n;
  }
  static std::atomic<int>& syncs() {
    static std::atomic<int> n{0};
    return n;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    const std::string_view name = fn.name();
    if (name == "aten::_foreach_norm") norms() += 1;
    if (name == "aten::_local_scalar_dense") syncs() += 1;
    return nullptr;
  }
  at::CallbackHandle handle_;
};

}  // namespace

// ---- reads right after a side-stream update ----------------------------------------------------

TEST_CASE("Races: module() right after a side-stream update reads the new average", "[cuda][race]") {
  auto seq = linear_stack(300);
  emakit::ModuleEma<torch::nn::SequentialImpl> ema(*seq, emakit::Fixed(0.5), {}, long_side_stream());
  module_read_rounds(
      seq, ema, [&] { return ema.update(); }, [&] { return ema.module()->parameters(); });
}

TEST_CASE("Races: TeacherStudent::teacher() right after a side-stream update", "[cuda][race]") {
  using ModuleEma = emakit::ModuleEma<torch::nn::SequentialImpl>;
  auto seq = linear_stack(300);
  ModuleEma ema(*seq, emakit::Fixed(0.5), {}, long_side_stream());
  emakit::TeacherStudent<ModuleEma> wrapper(*seq, ema, emakit::TeacherRoutes::paths({"0"}));
  module_read_rounds(
      seq, ema, [&] { return wrapper.update(); }, [&] { return wrapper.teacher().parameters(); });
}

// Before and after of one tensor (or the flat parameters) for one update.
struct Seen {
  at::Tensor before, source;
};

// An EMA with BatchNorm statistics after one round: parameters and statistics are the averages of
// what the update read, the count is the count it read.
void check_bn_round(const emakit::StateDict& got, const std::vector<std::string>& names, double w, const Seen& params,
                    const Seen& mean, const Seen& var, const at::Tensor& count) {
  CHECK(bad_elements(flat_copy(in_order(got, names)), lerp_expected(params.before, params.source, w)) == 0);
  CHECK(bad_elements(got["bn.running_mean"], lerp_expected(mean.before, mean.source, w)) == 0);
  CHECK(bad_elements(got["bn.running_var"], lerp_expected(var.before, var.source, w)) == 0);
  CHECK(torch::equal(got["bn.num_batches_tracked"].cpu(), count.cpu()));
}

TEST_CASE("Races: buffers written after update() and before wait() stay out of the average", "[cuda][race]") {
  Busy busy;
  torch::manual_seed(1);
  std::vector<emakit::SourceTensor> model;
  std::vector<at::Tensor> params;
  for (int i = 0; i < 300; ++i) {
    params.push_back(torch::randn({4096 + i}, on_dev()).to(torch::kBFloat16));
    model.push_back({fmt::format("p{}", i), params.back(), false});
  }
  // BatchNorm statistics as a forward pass leaves them: one fp32 (averaged in place) and one bf16
  // (averaged through a staging pool of the current stream), and the step count (copied).
  at::Tensor mean = torch::randn({256}, on_dev());
  at::Tensor var = (torch::rand({256}, on_dev()) + 0.5).to(torch::kBFloat16);
  at::Tensor count = torch::zeros({}, on_dev().dtype(torch::kLong));
  model.push_back({"bn.running_mean", mean, true});
  model.push_back({"bn.running_var", var, true});
  model.push_back({"bn.num_batches_tracked", count, true});
  std::vector<std::string> names;
  for (int i = 0; i < 300; ++i) names.push_back(model[static_cast<std::size_t>(i)].name);
  emakit::FixedEma ema(model, emakit::Fixed(0.5), {}, long_side_stream());
  Provocations provoked;
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    const auto avg = ema.averages();
    const at::Tensor before = as_double(flat_copy(in_order(avg, names)));
    const at::Tensor before_mean = as_double(avg["bn.running_mean"]);
    const at::Tensor before_var = as_double(avg["bn.running_var"]);
    busy.queue(100);
    step(params, round + 1.0);  // this step's optimizer step
    {
      torch::NoGradGuard no_grad;  // ... and what this step's forward left in the buffers
      mean.mul_(0.9).add_(0.1 * (round + 1));
      var.mul_(0.9).add_(0.05);
      count.add_(1);
    }
    const at::Tensor src = flat_copy(params), src_mean = mean.clone(), src_var = var.clone(), src_count = count.clone();
    const auto r = ema.update();
    REQUIRE(r.action == emakit::Action::averaged);
    {
      torch::NoGradGuard no_grad;  // the next forward, right after update(): before wait(), as allowed
      mean.fill_(1000.0);
      var.fill_(1000.0);
      count.add_(1000);
    }
    const bool held = busy.running();
    ema.wait_for_model_reads();  // before the next optimizer step, as documented
    step(params, 100.0);         // the next optimizer step
    const double w = 1.0 - r.decay;
    provoked.record(held, "the next forward's buffer writes");
    check_bn_round(ema.averages(), names, w, {before, src}, {before_mean, src_mean}, {before_var, src_var}, src_count);
  }
  provoked.require_each();
}

TEST_CASE("Races: a BatchNorm1d forward in train mode right after update()", "[cuda][race]") {
  Busy busy;
  torch::manual_seed(2);
  BnNet net(300);
  net->train();
  emakit::FixedEma ema(*net, emakit::Fixed(0.5), {}, long_side_stream());
  const auto params = net->parameters();
  const auto names = param_names(*net);
  const at::Tensor x = torch::randn({32, 64}, on_dev());
  Provocations provoked;
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    {
      torch::NoGradGuard no_grad;
      net->forward(x * (round + 2.0));  // this step's forward: the running statistics move
    }
    const auto avg = ema.averages();
    const at::Tensor before = as_double(flat_copy(in_order(avg, names)));
    const at::Tensor before_mean = as_double(avg["bn.running_mean"]);
    const at::Tensor before_var = as_double(avg["bn.running_var"]);
    busy.queue(100);
    step(params, round + 1.0);
    const at::Tensor src = flat_copy(params);
    const at::Tensor src_mean = net->bn->running_mean.clone(), src_var = net->bn->running_var.clone();
    const at::Tensor src_count = net->bn->num_batches_tracked.clone();
    const auto r = ema.update();
    REQUIRE(r.action == emakit::Action::averaged);
    {
      torch::NoGradGuard no_grad;
      net->forward(x * 10.0 + 50.0);  // the next forward, right after update(): moves the mean by ~5
    }
    const bool held = busy.running();
    ema.wait_for_model_reads();
    step(params, 100.0);
    const double w = 1.0 - r.decay;
    provoked.record(held, "the next forward");
    check_bn_round(ema.averages(), names, w, {before, src}, {before_mean, src_mean}, {before_var, src_var}, src_count);
  }
  provoked.require_each();
}

TEST_CASE("Races: gather_averages() and its kin right after a side-stream update", "[cuda][race][sharded]") {
  Busy busy;
  OneRankGroup one;
  Provocations provoked;  // each reader, over both placements
  INFO("process group: " << (EMAKIT_RACE_TESTS_GLOO ? "Gloo, one rank" : "bare c10d::ProcessGroup, one rank"));
  for (const bool offload : {false, true}) {
    INFO((offload ? "CPU-offloaded average" : "device average"));
    torch::manual_seed(3);
    ParamBag bag(300, 4096, torch::kBFloat16);
    auto options = long_side_stream();
    if (offload) options.device(torch::kCPU);
    emakit::ShardedEma ema(*bag, emakit::Fixed(0.5), {}, options,
                           emakit::ShardedStorage(one.group, std::chrono::seconds(60)));
    const auto names = param_names(*bag);
    // One round: the optimizer step held behind busy work, the update, then `read` at once. The
    // readers copy to the host, which waits for the busy work: whether the race was provoked is
    // known before they run (held: the update had not started when they were called).
    auto run_round = [&](double value, auto&& read) {
      const at::Tensor before = as_double(flat_copy(in_order(ema.averages(), names)));
      busy.queue(100);
      step(bag->parameters(), value);
      const at::Tensor src = flat_copy(bag->parameters());
      const auto r = ema.update();
      const bool held = busy.running();
      REQUIRE(r.action == emakit::Action::averaged);
      read(before, src, 1.0 - r.decay, held);
    };
    for (int k = 0; k < 2; ++k) {
      INFO("gather_averages, round " << k);
      run_round(k + 1.0, [&](const at::Tensor& before, const at::Tensor& src, double w, bool held) {
        const auto gathered = emakit::gather_averages(ema);  // right after update(): no wait()
        const at::Tensor got = flat_copy(in_order(gathered, names));
        provoked.record(held, "gather_averages()");
        INFO("elements still holding the previous average: " << stale_elements(got, before));
        CHECK(bad_elements(got, lerp_expected(before, src, w)) == 0);
      });
    }
    {
      INFO("swap_gathered_into: it writes the model that the update reads");
      run_round(3.0, [&](const at::Tensor& before, const at::Tensor& src, double w, bool held) {
        {
          auto swapped = emakit::swap_gathered_into(ema, *bag);
          const at::Tensor in_model = flat_copy(bag->parameters());
          provoked.record(held, "swap_gathered_into()");
          // The model is bf16: the average rounded to it.
          CHECK(bad_elements(in_model, lerp_expected(before, src, w), 1e-2) == 0);
        }
        CHECK(torch::equal(flat_copy(bag->parameters()).cpu(), src.cpu()));  // its own weights again
      });
    }
    {
      INFO("save_sharded, loaded into a second EMA");
      run_round(4.0, [&](const at::Tensor& before, const at::Tensor& src, double w, bool held) {
        const auto dir = one.dir.path / (offload ? "ckpt_offload" : "ckpt");
        emakit::save_sharded(ema, dir);
        provoked.record(held, "save_sharded()");
        emakit::ShardedEma other(*bag, emakit::Fixed(0.5), {}, options,
                                 emakit::ShardedStorage(one.group, std::chrono::seconds(60)));
        emakit::load_sharded(other, dir);
        CHECK(bad_elements(flat_copy(in_order(other.averages(), names)), lerp_expected(before, src, w)) == 0);
      });
    }
  }
  provoked.require_each();
}

// ---- the next optimizer step ---------------------------------------------------------------------

namespace {

// Three rounds queued back to back behind one busy stretch (each optimizer step right behind the
// previous update), then the next optimizer step; the averages must be the chain of lerps of the
// sources each update saw. Run twice (`attempt`): the race must be provoked at least once.
void hook_attempt(Busy& busy, Provocations& provoked, bool before_step) {
  torch::manual_seed(4);
  ParamBag bag(300, 4096, torch::kBFloat16);
  emakit::EmaHook hook;
  hook.add(*bag, emakit::Recipe<emakit::Fixed, emakit::StepSchedule, emakit::FlatStorage>(emakit::Fixed(0.5), {},
                                                                                          long_side_stream()));
  hook.setup();
  auto& ema = hook.ema<emakit::FixedEma>("model");
  const auto names = param_names(*bag);
  at::Tensor expected = as_double(flat_copy(in_order(ema.averages(), names)));
  std::vector<at::Tensor> srcs;
  std::vector<double> weights;
  busy.queue(150);
  for (int round = 0; round < 3; ++round) {
    if (before_step) hook.before_optimizer_step();
    step(bag->parameters(), round + 1.0);
    srcs.push_back(flat_copy(bag->parameters()));
    const auto results = hook.after_optimizer_step();
    REQUIRE(results.size() == 1);
    REQUIRE(results[0].action == emakit::Action::averaged);
    weights.push_back(1.0 - results[0].decay);
  }
  if (before_step) hook.before_optimizer_step();
  step(bag->parameters(), 100.0);  // the next optimizer step
  const bool held = busy.running();
  const at::Tensor got = flat_copy(in_order(ema.averages(), names));
  for (std::size_t k = 0; k < srcs.size(); ++k) expected = lerp_expected(expected, srcs[k], weights[k]);
  provoked.record(held, "the next optimizer step");
  CHECK(bad_elements(got, expected) == 0);
}

void hook_rounds(bool before_step) {
  Busy busy;
  Provocations provoked;
  for (int attempt = 0; attempt < 2; ++attempt) {
    INFO("attempt " << attempt);
    hook_attempt(busy, provoked, before_step);
  }
  provoked.require_each();
}

}  // namespace

TEST_CASE("Races: EmaHook without before_optimizer_step(): the next step stays out", "[cuda][race][hook]") {
  hook_rounds(/*before_step=*/false);
}

TEST_CASE("Races: EmaHook with before_optimizer_step(): the next step stays out", "[cuda][race][hook]") {
  hook_rounds(/*before_step=*/true);
}

TEST_CASE("Races: offload + side stream: wait() orders the copies, not the host pass", "[cuda][race][offload]") {
  Busy busy;
  torch::manual_seed(5);
  const std::int64_t big = dev.is_cuda() ? std::int64_t{1} << 26 : std::int64_t{1} << 20;
  std::vector<emakit::SourceTensor> model;
  std::vector<at::Tensor> ts, smalls;
  model.push_back({"big", torch::randn({big}, on_dev()).to(torch::kBFloat16), false});
  for (int i = 0; i < 50; ++i) {
    model.push_back({fmt::format("small{}", i), torch::randn({1000 + i}, on_dev()).to(torch::kBFloat16), false});
    smalls.push_back(model.back().tensor);
  }
  std::int64_t params = 0;
  for (const auto& t : model) {
    ts.push_back(t.tensor);
    params += t.tensor.numel();
  }
  std::vector<std::string> small_names;
  for (std::size_t i = 1; i < model.size(); ++i) small_names.push_back(model[i].name);
  emakit::FixedEma ema(model, emakit::Fixed(0.5), {}, emakit::EmaOptions().device(torch::kCPU).side_stream(true));
  ema.update();  // a first update: pinned staging and the host thread warm
  ema.wait_for_update();
  const at::Tensor sample = torch::arange(0, big, 4099, torch::TensorOptions().dtype(torch::kLong));
  const at::Tensor sample_dev = sample.to(dev);
  for (int round = 0; round < 2; ++round) {
    INFO("round " << round);
    const auto avg = ema.averages();
    REQUIRE(avg["big"].device().is_cpu());
    const at::Tensor before_big = as_double(avg["big"].index_select(0, sample));
    const at::Tensor before_small = as_double(flat_copy(in_order(avg, small_names)));
    busy.queue(300);
    step(ts, round + 1.0);
    const at::Tensor src_big = model[0].tensor.index_select(0, sample_dev);
    const at::Tensor src_small = flat_copy(smalls);
    const auto t0 = Clock::now();
    const auto r = ema.update();
    const double update_ms = ms_since(t0);
    ema.wait_for_model_reads();
    const double wait_ms = ms_since(t0) - update_ms;
    // The copies wait() orders the device after had not even started (they wait for the busy
    // work): the host pass, which reads them, cannot have finished, so wait() did not join it.
    const bool copies_pending = busy.running();
    step(ts, 100.0);  // the next optimizer step, ordered after the copies by wait()
    const auto t1 = Clock::now();
    const auto got = ema.averages();  // joins the host pass
    const double settle_ms = ms_since(t1);
    REQUIRE(r.action == emakit::Action::averaged);
    const double w = 1.0 - r.decay;
    INFO("the current stream was idle when wait() returned: wait() joined the host pass, or the busy work was "
         "too short to tell");
    if (dev.is_cuda()) {
      WARN(fmt::format("offload + side stream, {} params: update() returned in {:.2f} ms, wait() in {:.3f} ms, "
                       "then averages() (joins the host pass) took {:.1f} ms; the current stream was {} after wait()",
                       params, update_ms, wait_ms, settle_ms, copies_pending ? "still busy" : "idle"));
      CHECK(copies_pending);
    }
    CHECK(bad_elements(got["big"].index_select(0, sample), lerp_expected(before_big, src_big, w)) == 0);
    CHECK(bad_elements(flat_copy(in_order(got, small_names)), lerp_expected(before_small, src_small, w)) == 0);
  }
}

// ---- memory ----------------------------------------------------------------------------------------

TEST_CASE("GPU bytes an EMA holds per parameter, and no allocation per update", "[cuda][memory]") {
#if EMAKIT_RACE_TESTS_ALLOCATOR_STATS
  if (!dev.is_cuda()) EMAKIT_CUDA_UNAVAILABLE("the device allocator statistics are for CUDA only (a CPU build)");
  // 64M parameters in 256 tensors of 1 MiB (in fp32) each, four times the staging bound.
  constexpr std::int64_t tensors = 256, each = std::int64_t{1} << 18, params = tensors * each;
  constexpr std::int64_t staging = std::int64_t{16} << 20, slack = std::int64_t{1} << 20;
  struct Case {
    std::string label;
    torch::Dtype dtype;
    emakit::EmaOptions options;
    std::int64_t bytes_per_param;  // of the average on the GPU
    std::int64_t staging;          // the staging bound, on top
  };
  const std::vector<Case> cases{
      {"fp32->fp32", torch::kFloat, emakit::EmaOptions().staging_bytes(staging), 4, 0},
      {"bf16->fp32", torch::kBFloat16, emakit::EmaOptions().staging_bytes(staging), 4, staging},
      {"bf16->fp32/side_stream", torch::kBFloat16, emakit::EmaOptions().staging_bytes(staging).side_stream(true), 4,
       staging},
      {"bf16->bf16/keep_model_dtype", torch::kBFloat16, emakit::EmaOptions().keep_model_dtype(true), 2, 0},
      {"bf16->cpu_fp32/offload", torch::kBFloat16, emakit::EmaOptions().device(torch::kCPU), 0, 0},
  };
  auto* allocator = c10::getDeviceAllocator(c10::kCUDA);
  auto allocated_bytes = [&] { return allocator->getDeviceStats(dev.index()).allocated_bytes[0].current; };
  auto allocations = [&] { return allocator->getDeviceStats(dev.index()).allocation[0].allocated; };
  for (const auto& c : cases) {
    INFO(c.label);
    std::vector<emakit::SourceTensor> model;
    std::vector<at::Tensor> ts;
    for (std::int64_t i = 0; i < tensors; ++i) {
      ts.push_back(torch::randn({each}, on_dev()).to(c.dtype));
      model.push_back({fmt::format("p{}", i), ts.back(), false});
    }
    device_sync();
    const auto base = allocated_bytes();
    {
      emakit::FixedEma ema(model, emakit::Fixed(0.999), {}, c.options);
      ema.update();
      ema.wait_for_update();
      device_sync();
      const auto held = static_cast<std::int64_t>(allocated_bytes() - base);
      const double per_param = static_cast<double>(held) / static_cast<double>(params);
      std::cout << fmt::format("BYTES_PER_PARAM {} {:.4f}\n", c.label, per_param) << std::flush;
      INFO("held " << held << " bytes for " << params << " parameters (" << per_param << " per parameter)");
      CHECK(held >= c.bytes_per_param * params);
      CHECK(held <= c.bytes_per_param * params + c.staging + slack);
      // Updates after the first allocate nothing on the device (the optimizer steps in between are
      // not counted).
      std::int64_t made = 0;
      for (int k = 0; k < 3; ++k) {
        ema.wait_for_model_reads();
        step(ts, k + 1.0);
        device_sync();
        const auto n0 = allocations();
        ema.update();
        ema.wait_for_update();
        device_sync();
        made += static_cast<std::int64_t>(allocations() - n0);
      }
      CHECK(made == 0);
    }
  }
#else
  EMAKIT_CUDA_UNAVAILABLE(
      "this LibTorch has no device-generic allocator statistics (c10/core/CachingDeviceAllocator.h): "
      "the GPU bytes per parameter and the allocations per update were not measured");
#endif
}

// ---- skip_non_finite -----------------------------------------------------------------------------------

TEST_CASE("skip_non_finite on CUDA: NaN and inf are found, huge finite values are not", "[cuda][non_finite]") {
  for (const bool side : {false, true}) {
    INFO("side stream " << side);
    torch::manual_seed(6);
    std::vector<emakit::SourceTensor> model;
    const torch::Dtype dtypes[] = {torch::kBFloat16, torch::kHalf, torch::kFloat};
    for (int i = 0; i < 300; ++i)
      model.push_back({fmt::format("t{}", i), torch::randn({1000 + i}, on_dev()).to(dtypes[i % 3]), false});
    std::vector<std::string> names;
    std::vector<at::Tensor> ts;
    for (const auto& t : model) {
      names.push_back(t.name);
      ts.push_back(t.tensor);
    }
    emakit::FixedEma ema(model, emakit::Fixed(0.5), {}, emakit::EmaOptions().skip_non_finite(true).side_stream(side));
    REQUIRE(ema.update().action == emakit::Action::averaged);
    const double inf = std::numeric_limits<double>::infinity();
    struct Poison {
      std::size_t tensor;
      double value;
      const char* what;
    };
    std::int64_t skipped = 0;
    for (const auto& p : {Poison{150, std::nan(""), "a NaN in a bf16 tensor"},
                          Poison{151, inf, "+inf in an fp16 tensor"}, Poison{152, -inf, "-inf in an fp32 tensor"}}) {
      INFO(p.what);
      const at::Tensor before = flat_copy(in_order(ema.averages(), names)).cpu();
      at::Tensor& t = model[p.tensor].tensor;
      const at::Tensor saved = t.clone();
      {
        torch::NoGradGuard no_grad;
        t.narrow(0, 7, 1).fill_(p.value);
      }
      emakit::UpdateResult r;
      int syncs = 0;
      {
        OpCensus census;
        r = ema.update();
        syncs = OpCensus::host_syncs();
      }
      skipped += 1;
      CHECK(r.action == emakit::Action::skipped);
      CHECK(r.non_finite == model[p.tensor].name);
      CHECK(ema.non_finite_updates() == skipped);
      CHECK(torch::equal(flat_copy(in_order(ema.averages(), names)).cpu(), before));  // unchanged, bitwise
      if (dev.is_cuda() && syncs > 1)
        WARN(p.what << ": the skipped update synced the host " << syncs
                    << " times (finding which tensor to name); the check itself syncs once");
      torch::NoGradGuard no_grad;
      t.copy_(saved);
    }
    // The largest finite values of each dtype are no infinity (an L2 norm of them would overflow).
    {
      torch::NoGradGuard no_grad;
      model[150].tensor.narrow(0, 7, 1).fill_(3.0e38);   // bf16, max 3.39e38
      model[151].tensor.narrow(0, 7, 1).fill_(65504.0);  // fp16 max
      model[152].tensor.narrow(0, 7, 1).fill_(3.0e38);   // fp32
    }
    const at::Tensor before = as_double(flat_copy(in_order(ema.averages(), names)));
    const at::Tensor src = as_double(flat_copy(ts, torch::kFloat));
    emakit::UpdateResult r;
    int norms = 0, syncs = 0;
    {
      OpCensus census;
      r = ema.update();
      norms = OpCensus::norm_calls();
      syncs = OpCensus::host_syncs();
    }
    CHECK(r.action == emakit::Action::averaged);
    CHECK(r.non_finite.empty());
    CHECK(ema.non_finite_updates() == skipped);
    const at::Tensor got = flat_copy(in_order(ema.averages(), names));
    CHECK(bad_elements(got, lerp_expected(before, src, 1.0 - r.decay)) == 0);
    CHECK(torch::isfinite(got).all().item<bool>());
    if (dev.is_cuda()) {
      INFO("_foreach_norm calls " << norms << ", host syncs " << syncs << " in one checked update of 3 dtypes");
      CHECK(norms == 3);  // one per (device, dtype)
      CHECK(syncs <= 1);
    }
  }
}

#undef EMAKIT_RACE_TESTS_GLOO
#undef EMAKIT_RACE_TESTS_ALLOCATOR_STATS

}  // namespace test_cuda_races
