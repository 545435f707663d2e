// ShardedStorage (include/emakit/sharded.hpp) with real rank processes over Gloo on loopback.
// Each TEST_CASE starts its ranks (launcher.hpp); each RANK_CASE runs in one rank process,
// computes the single-process reference itself (every rank replays the same trajectory) and
// exits 0 when everything it checks held.
#include "launcher.hpp"

#include "../helpers.hpp"

#include <emakit/emakit.hpp>
#include <emakit/sharded.hpp>

#include <catch2/catch.hpp>
#include <torch/nn/modules/container/sequential.h>

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#if EMAKIT_HAVE_GLOO
#include <emakit/gloo.hpp>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#endif

using emakit_dist::launch;
using emakit_dist::RankArgs;
using emakit_test::TempDir;

namespace {

// ---- the parent side ------------------------------------------------------------------------

void require_all_passed(const emakit_dist::Launch& run) {
  INFO(run.describe());
  for (const auto& r : run.ranks) CHECK(r.passed());
}

bool any_log_contains(const emakit_dist::Launch& run, const std::string& text) {
  for (const auto& r : run.ranks)
    if (r.log.find(text) != std::string::npos) return true;
  return false;
}

// The file of rank r of N in a checkpoint folder (its name carries the save's id).
std::filesystem::path shard_file(const std::filesystem::path& ckpt, int r, int world) {
  const std::string prefix = "rank-" + std::to_string(r) + "-of-" + std::to_string(world) + ".";
  std::vector<std::filesystem::path> found;
  for (const auto& e : std::filesystem::directory_iterator(ckpt))
    if (e.path().filename().string().rfind(prefix, 0) == 0) found.push_back(e.path());
  REQUIRE(found.size() == 1);
  return found.front();
}

std::size_t count_files(const std::filesystem::path& ckpt) {
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(ckpt)) n += e.is_regular_file() ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("sharded EMA: the gathered average equals the single-process EMA bitwise, every policy, 2 and 4 ranks",
          "[distributed]") {
  TempDir dir;
  for (int world : {2, 4}) require_all_passed(launch("bitwise", world, dir.path));
}

TEST_CASE("sharded EMA: each rank holds about 1/N of the average's bytes, 1, 2 and 4 ranks", "[distributed]") {
  TempDir dir;
  for (int world : {1, 2, 4}) {
    const auto run = launch("memory", world, dir.path);
    require_all_passed(run);
    CHECK(any_log_contains(run, "held_bytes"));
  }
}

TEST_CASE("sharded checkpoint: saved by 4 ranks, loaded by 2 ranks and by 4 (resharding), then training goes on",
          "[distributed]") {
  TempDir dir;
  for (const std::string mode : {"whole", "sliced"}) {
    require_all_passed(launch("save", 4, dir.path, 60, mode));
    REQUIRE(std::filesystem::exists(dir.path / (mode + "-ckpt") / "index.pt"));
    REQUIRE(std::filesystem::exists(shard_file(dir.path / (mode + "-ckpt"), 3, 4)));
    require_all_passed(launch("load", 2, dir.path, 60, mode));
    require_all_passed(launch("load", 4, dir.path, 60, mode));
  }
}

TEST_CASE("sharded checkpoint: a mixed, incomplete or damaged set is refused naming the file, the EMA unchanged",
          "[distributed]") {
  TempDir dir;
  const auto good = dir.path / "whole-ckpt";
  require_all_passed(launch("save", 4, dir.path, 60, "whole"));
  TempDir other;  // a second save: another save id
  require_all_passed(launch("save", 4, other.path, 60, "whole"));

  // Each case: a copy of the good checkpoint, spoiled, loaded by 2 ranks.
  auto refused = [&](const std::string& name, const std::function<void(const std::filesystem::path&)>& spoil,
                     const std::string& expected) {
    const auto work = dir.path / name;
    std::filesystem::create_directories(work);
    std::filesystem::copy(good, work / "whole-ckpt", std::filesystem::copy_options::recursive);
    spoil(work / "whole-ckpt");
    const auto run = launch("load_error", 2, dir.path, 60, "whole", work.string());
    INFO(name);
    require_all_passed(run);
    CHECK(any_log_contains(run, expected));
  };
  refused(
      "mixed",
      [&](const std::filesystem::path& c) {  // another save's file under this save's name
        std::filesystem::copy_file(shard_file(other.path / "whole-ckpt", 1, 4), shard_file(c, 1, 4),
                                   std::filesystem::copy_options::overwrite_existing);
      },
      "': belongs to another save");
  refused(
      "missing", [](const std::filesystem::path& c) { std::filesystem::remove(shard_file(c, 3, 4)); }, "' is missing");
  refused(
      "no-index", [](const std::filesystem::path& c) { std::filesystem::remove(c / "index.pt"); }, "no index");
  refused(
      "damaged",
      [](const std::filesystem::path& c) {
        const auto file = shard_file(c, 2, 4);
        std::string bytes = emakit_test::read_bytes(file);
        bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x5A);
        emakit_test::write_bytes(file, bytes);
      },
      "rank-2-of-4.");
}

TEST_CASE("sharded checkpoint: a save that stops half-way leaves the previous checkpoint whole, the next save "
          "cleans up",
          "[distributed]") {
  TempDir dir, other;
  const auto ckpt = dir.path / "whole-ckpt";
  require_all_passed(launch("save", 4, dir.path, 60, "whole"));
  require_all_passed(launch("save", 4, other.path, 60, "whole"));
  REQUIRE(count_files(ckpt) == 5);  // 4 rank files and the index
  // What a save killed before its index leaves: every rank's file under the new save's id (here
  // another run's, 2 ranks' worth) and no new index. The previous checkpoint loads, bitwise.
  for (int r : {0, 1})
    std::filesystem::copy_file(shard_file(other.path / "whole-ckpt", r, 4),
                               ckpt / ("rank-" + std::to_string(r) + "-of-4.00000000000000ff.pt"));
  require_all_passed(launch("load", 2, dir.path, 60, "whole"));
  // The next save commits and removes every file that is not its own.
  require_all_passed(launch("save", 4, dir.path, 60, "whole"));
  CHECK(count_files(ckpt) == 5);
  require_all_passed(launch("load", 4, dir.path, 60, "whole"));
}

TEST_CASE("sharded EMA: a killed rank gives the others an error within the timeout, not a hang", "[distributed]") {
  TempDir dir;
  for (int world : {2, 4}) {
    const auto run = launch("fail", world, dir.path, 40, "kill");
    INFO(run.describe());
    CHECK(run.ranks.back().signal == SIGKILL);
    for (int r = 0; r + 1 < world; ++r) CHECK(run.ranks[static_cast<std::size_t>(r)].passed());
    CHECK(any_log_contains(run, "error after"));
  }
}

TEST_CASE("sharded EMA: a stalled rank gives the others a timeout error", "[distributed]") {
  TempDir dir;
  const auto run = launch("fail", 2, dir.path, 40, "stall");
  INFO(run.describe());
  CHECK(run.ranks[0].passed());
  CHECK(any_log_contains(run, "error after"));
}

TEST_CASE("sharded EMA: ranks whose update counters differ are named at the next gather", "[distributed]") {
  TempDir dir;
  require_all_passed(launch("mismatch", 2, dir.path));
}

TEST_CASE("sharded EMA: already-sharded parameters (local slices) gather to the single-process EMA, 2 and 4 ranks",
          "[distributed]") {
  TempDir dir;
  for (int world : {2, 4}) require_all_passed(launch("slices", world, dir.path));
}

TEST_CASE("sharded EMA: bad inputs are errors that name the value", "[distributed]") {
  TempDir dir;
  require_all_passed(launch("bad_inputs", 2, dir.path));
}

TEST_CASE("sharded EMA: update() during a gathered swap is refused as during a plain swap, the model and EMA "
          "intact after",
          "[distributed]") {
  TempDir dir;
  require_all_passed(launch("swap_refuses_update", 2, dir.path));
}

TEST_CASE("sharded EMA: emakit::save and emakit::load write and read a sharded checkpoint, strictly", "[distributed]") {
  TempDir dir;
  require_all_passed(launch("save_load_dispatch", 2, dir.path));
  CHECK(std::filesystem::exists(dir.path / "via-save" / "index.pt"));
  CHECK(count_files(dir.path / "via-save") == 3);  // 2 rank files and the index
}

#if EMAKIT_HAVE_GLOO
// ---- the rank side --------------------------------------------------------------------------
namespace {

using namespace std::chrono_literals;

#define RANK_CHECK(cond, ...)                                                         \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "rank check failed at line %d: %s: %s\n", __LINE__, #cond, \
                   fmt::format(__VA_ARGS__).c_str());                                 \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

// Linear layers of several sizes, a BatchNorm (float running stats, int64 num_batches_tracked)
// and a layer registered twice ("b" and "b_again": tied tensors, one average under two names).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(5, 16));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    b = register_module("b", torch::nn::Linear(16, 16));
    c = register_module("c", torch::nn::Linear(16, 3));
    register_module("b_again", b);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(7);
  return Net();
}

// The optimizer step of step `step`: the same on every rank.
void step_model(torch::nn::Module& m, std::int64_t step) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(1000 + step);
  for (auto& p : m.parameters()) p.add_(torch::randn_like(p) * 0.05);
  for (auto& b : m.buffers()) {
    if (b.is_floating_point())
      b.add_(torch::randn_like(b) * 0.01);
    else
      b.add_(1);
  }
}

c10::intrusive_ptr<c10d::ProcessGroup> make_group(const RankArgs& a, std::chrono::milliseconds timeout = 20s) {
  auto store = c10::make_intrusive<c10d::FileStore>(a.store, a.world);
  return emakit::make_gloo_group(store, a.rank, a.world, timeout);
}

// Whether two dictionaries hold the same names with bitwise equal tensors; `why` says where not.
bool same(const emakit::StateDict& a, const emakit::StateDict& b, std::string& why) {
  if (a.size() != b.size()) {
    why = fmt::format("{} entries vs {}", a.size(), b.size());
    return false;
  }
  for (const auto& item : a) {
    const at::Tensor* t = b.find(item.key());
    if (t == nullptr) {
      why = "missing " + item.key();
      return false;
    }
    if (!emakit_test::bitwise_equal(item.value(), *t)) {
      why = "differs: " + item.key();
      return false;
    }
  }
  return true;
}

// A sharded EMA and a plain one over the same trajectory; gathers at several points.
template <class D>
int bitwise_for(const RankArgs& a, const c10::intrusive_ptr<c10d::ProcessGroup>& group, D decay,
                emakit::StepSchedule schedule, emakit::EmaOptions options, const char* label) {
  Net model = make_net();
  emakit::Ema<D, emakit::StepSchedule, emakit::FlatStorage> plain(*model, decay, schedule, options);
  emakit::Ema<D, emakit::StepSchedule, emakit::ShardedStorage> sharded(*model, decay, schedule, options,
                                                                       emakit::ShardedStorage(group, 20s));
  std::string why;
  for (std::int64_t step = 1; step <= 24; ++step) {
    step_model(*model, step);
    plain.update();
    sharded.update();
    if (step == 1 || step == 10) {
      const auto full = emakit::gather_averages(sharded);
      RANK_CHECK(same(full, plain.averages(), why), "{} at step {}: {}", label, step, why);
    }
  }
  RANK_CHECK(same(emakit::gather_averages(sharded), plain.averages(), why), "{}: {}", label, why);
  const int last = a.world - 1;
  const auto on_last = emakit::gather_averages(sharded, last);
  if (a.rank == last)
    RANK_CHECK(same(on_last, plain.averages(), why), "{} gathered to rank {}: {}", label, last, why);
  else
    RANK_CHECK(on_last.is_empty(), "{}: rank {} received {} tensors of a gather to rank {}", label, a.rank,
               on_last.size(), last);
  // A plain Ema loads the gathered state and then holds what the plain one holds.
  const auto state = emakit::gather_state_dict(sharded, 0);
  if (a.rank == 0) {
    emakit::Ema<D, emakit::StepSchedule, emakit::FlatStorage> restored(*make_net(), decay, schedule, options);
    restored.load_state_dict(state);
    RANK_CHECK(same(restored.state_dict(), plain.state_dict(), why), "{} state: {}", label, why);
  }
  // Swapped in, the model holds the plain EMA's weights; afterwards its own again.
  const auto own = emakit_test::snapshot(model->named_parameters());
  {
    auto swapped = emakit::swap_gathered_into(sharded, *model);
    for (const auto& p : model->named_parameters())
      RANK_CHECK(emakit_test::bitwise_equal(p.value(), plain.average(p.key()).to(p.value().scalar_type())),
                 "{} swapped: {}", label, p.key());
  }
  RANK_CHECK(emakit_test::same_averages(model->named_parameters(), own), "{}: not restored after the swap", label);
  std::printf("%s: rank %d holds %lld of %lld bytes, bitwise equal\n", label, a.rank,
              static_cast<long long>(sharded.storage().held_bytes()),
              static_cast<long long>(sharded.storage().total_bytes()));
  return 0;
}

RANK_CASE("bitwise") {
  auto group = make_group(args);
  using emakit::StepSchedule;
  int bad = 0;
  bad += bitwise_for(args, group, emakit::Fixed(0.9), StepSchedule(), {}, "Fixed");
  bad += bitwise_for(args, group, emakit::ExponentialRamp(0.999, 5), StepSchedule(), {}, "ExponentialRamp");
  bad += bitwise_for(args, group, emakit::InversePowerWarmup(0.999).update_after_step(3),
                     StepSchedule().update_every(2).start_step(4).warmup(emakit::Warmup::copy_before_start), {},
                     "InversePowerWarmup, copy before start, every 2");
  bad += bitwise_for(args, group, emakit::PowerFunction::from_sigma_rel(0.1),
                     StepSchedule().start_step(3).warmup(emakit::Warmup::skip_before_start), {}, "PowerFunction");
  bad += bitwise_for(args, group, emakit::Uniform(), StepSchedule().accumulate(3),
                     emakit::EmaOptions().dtype(at::kDouble), "Uniform, accumulate 3, float64 average");
  return bad == 0 ? 0 : 1;
}

RANK_CASE("memory") {
  auto group = make_group(args);
  // 16 layers of 64x64 + 64: balanced by bytes, each rank holds about 1/N.
  std::vector<emakit::SourceTensor> tensors;
  torch::manual_seed(3);
  for (int i = 0; i < 16; ++i) {
    tensors.push_back({fmt::format("layer{}.weight", i), torch::randn({64, 64}), false});
    tensors.push_back({fmt::format("layer{}.bias", i), torch::randn({64}), false});
  }
  emakit::ShardedEma ema(tensors, emakit::Fixed(0.99), {}, {}, emakit::ShardedStorage(group, 20s));
  const auto& st = ema.storage();
  const double share = static_cast<double>(st.held_bytes()) / static_cast<double>(st.total_bytes());
  std::printf("held_bytes %lld of %lld (%.3f, 1/N = %.3f), %zu of %zu tensors\n",
              static_cast<long long>(st.held_bytes()), static_cast<long long>(st.total_bytes()), share,
              1.0 / args.world, ema.averages().size(), tensors.size());
  RANK_CHECK(share >= 0.9 / args.world && share <= 1.1 / args.world, "share {} for {} ranks", share, args.world);
  const auto rows = st.exchange({st.held_bytes()}, "sum");
  std::int64_t sum = 0;
  for (const auto& r : rows) sum += r[0];
  RANK_CHECK(sum == st.total_bytes(), "held bytes sum to {}, the whole average has {}", sum, st.total_bytes());
  // A 1-rank group holds everything and gathers without communication.
  for (int step = 1; step <= 3; ++step) {
    for (auto& t : tensors) t.tensor.add_(1.0);
    ema.update();
  }
  const auto full = emakit::gather_averages(ema);
  RANK_CHECK(full.size() == tensors.size(), "gathered {} tensors", full.size());
  return 0;
}

// The EMA of the save / load cases: whole tensors of the model, or its local slices.
struct Subject {
  Net model = make_net();
  emakit::FixedEma plain{*model, emakit::Fixed(0.8)};
  std::optional<emakit::ShardedEma> sharded;

  Subject(const RankArgs& a, const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::string& mode,
          std::int64_t steps) {
    for (std::int64_t s = 1; s <= steps; ++s) {
      step_model(*model, s);
      plain.update();
    }
    emakit::ShardedStorage storage(group, 20s);
    if (mode == "sliced") {
      std::vector<emakit::SourceTensor> local;
      for (const auto& t : emakit::detail::collect(*model)) {
        const auto shape = t.tensor.sizes().vec();
        if (!t.tensor.is_floating_point()) {
          local.push_back(t);  // num_batches_tracked: replicated
          continue;
        }
        const auto shard = shape.size() == 2 ? emakit::LocalShard::dim0_chunk(shape, a.rank, a.world)
                                             : emakit::LocalShard::flat_chunk(shape, a.rank, a.world);
        const std::int64_t n = shape.size() == 2
                                   ? emakit::LocalShard::dim0_chunk_rows(shape[0], a.rank, a.world) * shape[1]
                                   : emakit::LocalShard::flat_chunk_numel(t.tensor.numel(), a.rank, a.world);
        at::Tensor flat = t.tensor.detach().view({-1}).narrow(0, shard.offset, n);
        local.push_back({t.name, shape.size() == 2 ? flat.view({n / shape[1], shape[1]}) : flat, t.is_buffer});
        storage.local_shard(t.name, shard);
      }
      sharded.emplace(local, emakit::Fixed(0.8), emakit::StepSchedule(), emakit::EmaOptions(), storage);
    } else {
      sharded.emplace(*model, emakit::Fixed(0.8), emakit::StepSchedule(), emakit::EmaOptions(), storage);
    }
  }
  // Both EMAs run `steps` more steps of the trajectory.
  void train(std::int64_t from, std::int64_t steps) {
    for (std::int64_t s = from; s < from + steps; ++s) {
      step_model(*model, s);
      plain.update();
      sharded->update();
    }
  }
};

RANK_CASE("save") {
  auto group = make_group(args);
  Subject s(args, group, args.arg, 0);
  s.train(1, 12);
  std::string why;
  RANK_CHECK(same(emakit::gather_averages(*s.sharded), s.plain.averages(), why), "{}", why);
  emakit::save_sharded(*s.sharded, std::filesystem::path(args.dir) / (args.arg + "-ckpt"));
  return 0;
}

RANK_CASE("load") {
  auto group = make_group(args);
  Subject s(args, group, args.arg, 12);  // the model and plain EMA after 12 steps; a fresh sharded EMA
  emakit::load_sharded(*s.sharded, std::filesystem::path(args.dir) / (args.arg + "-ckpt"));
  std::string why;
  RANK_CHECK(same(emakit::gather_averages(*s.sharded), s.plain.averages(), why), "after loading: {}", why);
  RANK_CHECK(s.sharded->step() == 12 && s.sharded->num_updates() == 12, "counters step {} num_updates {}",
             s.sharded->step(), s.sharded->num_updates());
  s.train(13, 5);
  RANK_CHECK(same(emakit::gather_averages(*s.sharded), s.plain.averages(), why), "5 steps later: {}", why);
  std::printf("loaded a 4-rank checkpoint on %d ranks (%s); bitwise equal, also 5 steps later\n", args.world,
              args.arg.c_str());
  return 0;
}

RANK_CASE("load_error") {
  auto group = make_group(args);
  Subject s(args, group, args.arg, 12);
  s.train(13, 2);
  const auto before = emakit_test::snapshot(s.sharded->averages());
  const auto step = s.sharded->step();
  try {
    emakit::load_sharded(*s.sharded, std::filesystem::path(args.dir) / (args.arg + "-ckpt"));
  } catch (const std::exception& e) {
    std::printf("load refused: %s\n", e.what());
    RANK_CHECK(emakit_test::same_averages(s.sharded->averages(), before), "a failed load changed the averages");
    RANK_CHECK(s.sharded->step() == step, "a failed load changed the step to {}", s.sharded->step());
    return 0;
  }
  RANK_CHECK(false, "the load did not fail");
}

RANK_CASE("fail") {
  const auto timeout = 3000ms;
  auto group = make_group(args, timeout);
  Net model = make_net();
  emakit::ShardedEma ema(*model, emakit::Fixed(0.9), {}, {}, emakit::ShardedStorage(group, timeout));
  for (int s = 1; s <= 3; ++s) {
    step_model(*model, s);
    ema.update();
  }
  (void)emakit::gather_averages(ema);  // everyone alive: works
  if (args.rank == args.world - 1) {
    if (args.arg == "kill") ::raise(SIGKILL);
    std::this_thread::sleep_for(7s);  // stalled past the others' timeout, then gone
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)emakit::gather_averages(ema);
  } catch (const std::runtime_error& e) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank %d: error after %.2f s: %s\n", args.rank, seconds, e.what());
    RANK_CHECK(seconds < 3.0 + 5.0, "the error came after {} s, the timeout is 3 s", seconds);
    RANK_CHECK(std::string(e.what()).find("emakit::gather_averages") != std::string::npos, "{}", e.what());
    return 0;
  }
  RANK_CHECK(false, "gather_averages did not fail with a dead or stalled rank");
}

RANK_CASE("mismatch") {
  auto group = make_group(args);
  Net model = make_net();
  emakit::ShardedEma ema(*model, emakit::Fixed(0.9), {}, {}, emakit::ShardedStorage(group, 20s));
  const int steps = args.rank == 1 ? 6 : 5;  // rank 1 updates once more
  for (int s = 1; s <= steps; ++s) {
    step_model(*model, s);
    ema.update();
  }
  try {
    (void)emakit::gather_averages(ema);
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    std::printf("rank %d: %s\n", args.rank, m.c_str());
    RANK_CHECK(m.find("counters disagree") != std::string::npos, "{}", m);
    RANK_CHECK(m.find("rank 0: calls 5, step 5") != std::string::npos, "{}", m);
    RANK_CHECK(m.find("rank 1: calls 6, step 6") != std::string::npos, "{}", m);
    return 0;
  }
  RANK_CHECK(false, "no error for ranks with different counters");
}

RANK_CASE("slices") {
  auto group = make_group(args);
  Subject s(args, group, "sliced", 0);
  s.train(1, 20);
  std::string why;
  RANK_CHECK(same(emakit::gather_averages(*s.sharded), s.plain.averages(), why), "{}", why);
  const auto on0 = emakit::gather_averages(*s.sharded, 0);
  if (args.rank == 0) RANK_CHECK(same(on0, s.plain.averages(), why), "to rank 0: {}", why);
  // The rank's own averages are the slices of the single-process average.
  for (const auto& item : s.sharded->averages()) {
    const auto& full = s.plain.average(item.key());
    if (!full.is_floating_point()) continue;
    const auto shard = full.dim() == 2 ? emakit::LocalShard::dim0_chunk(full.sizes().vec(), args.rank, args.world)
                                       : emakit::LocalShard::flat_chunk(full.sizes().vec(), args.rank, args.world);
    RANK_CHECK(emakit_test::bitwise_equal(item.value().reshape({-1}),
                                          full.reshape({-1}).narrow(0, shard.offset, item.value().numel())),
               "the local average of {} is not the slice of the average", item.key());
  }
  std::printf("rank %d holds %lld of %lld bytes of sliced averages\n", args.rank,
              static_cast<long long>(s.sharded->storage().held_bytes()),
              static_cast<long long>(s.sharded->storage().total_bytes()));
  return 0;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

RANK_CASE("bad_inputs") {
  auto group = make_group(args);
  Net model = make_net();
  std::string m = error_of([&] { emakit::ShardedStorage(c10::intrusive_ptr<c10d::ProcessGroup>()); });
  RANK_CHECK(m.find("process group is null") != std::string::npos, "{}", m);
  m = error_of([&] { emakit::ShardedStorage(group, 0ms); });
  RANK_CHECK(m.find("timeout must be > 0 ms, got 0") != std::string::npos, "{}", m);
  m = error_of([&] {
    emakit::ShardedEma(*model, {}, {}, {}, emakit::ShardedStorage(group).local_shard("nope.weight", {{4}, 0}));
  });
  RANK_CHECK(m.find("'nope.weight'") != std::string::npos, "{}", m);
  m = error_of([&] { emakit::LocalShard::dim0_chunk({4, 4}, 2, 2); });
  RANK_CHECK(m.find("rank must be in [0, 2), got 2") != std::string::npos, "{}", m);
  // Both ranks claim the first half of c.bias: an overlap and a hole, seen by every rank.
  m = error_of([&] {
    std::vector<emakit::SourceTensor> t{{"c.bias", model->c->bias.detach().narrow(0, 0, 2), false}};
    emakit::ShardedEma(t, {}, {}, {}, emakit::ShardedStorage(group).local_shard("c.bias", {{3}, 0}));
  });
  RANK_CHECK(m.find("the slices of 'c.bias' overlap") != std::string::npos, "{}", m);
  emakit::ShardedEma ema(*model, {}, {}, {}, emakit::ShardedStorage(group, 20s));
  m = error_of([&] { (void)emakit::gather_averages(ema, 5); });
  RANK_CHECK(m.find("destination rank must be in [0, 2) or all_ranks, got 5") != std::string::npos, "{}", m);
  // A load of a folder that holds nothing names the index it looked for.
  m = error_of([&] { emakit::load_sharded(ema, std::filesystem::path(args.dir) / "nothing-here"); });
  RANK_CHECK(m.find("no index") != std::string::npos, "{}", m);
  return 0;
}

// A gathered swap is the Ema's own SwapGuard: update() is refused with the plain swap's error,
// changes nothing, and works again once the guard has ended.
RANK_CASE("swap_refuses_update") {
  auto group = make_group(args);
  Net model = make_net();
  emakit::FixedEma plain(*model, emakit::Fixed(0.9));
  emakit::ShardedEma sharded(*model, emakit::Fixed(0.9), {}, {}, emakit::ShardedStorage(group, 20s));
  for (std::int64_t s = 1; s <= 4; ++s) {
    step_model(*model, s);
    plain.update();
    sharded.update();
  }
  std::string plain_error;
  {
    auto swapped = plain.swap_into();
    plain_error = error_of([&] { plain.update(); });
  }
  RANK_CHECK(plain_error.find("would average the EMA with itself") != std::string::npos, "{}", plain_error);
  const auto own = emakit_test::model_snapshot(*model);
  const auto share = emakit_test::snapshot(sharded.averages());
  const auto calls = sharded.calls();
  std::string why;
  {
    auto swapped = emakit::swap_gathered_into(sharded, *model);
    RANK_CHECK(swapped.active(), "the gathered swap's guard is not active");
    const std::string m = error_of([&] { sharded.update(); });
    RANK_CHECK(m == plain_error, "update() during the gathered swap: '{}', during a plain swap: '{}'", m, plain_error);
    RANK_CHECK(sharded.calls() == calls, "the refused update counted a call: {} -> {}", calls, sharded.calls());
    RANK_CHECK(emakit_test::same_averages(sharded.averages(), share), "the refused update changed the averages");
    for (const auto& p : model->named_parameters())
      RANK_CHECK(emakit_test::bitwise_equal(p.value(), plain.average(p.key()).to(p.value().scalar_type())),
                 "the model does not hold the EMA weights during the swap: {}", p.key());
    // A second gathered swap while this one is open is refused too (a collective: every rank).
    const std::string again = error_of([&] { (void)emakit::swap_gathered_into(sharded, *model); });
    RANK_CHECK(again.find("already holds an EMA's weights") != std::string::npos, "{}", again);
  }
  RANK_CHECK(emakit_test::same_snapshot(emakit_test::model_snapshot(*model), own), "the model was not restored");
  RANK_CHECK(emakit_test::same_averages(sharded.averages(), share), "the swap changed the averages");
  RANK_CHECK(same(emakit::gather_averages(sharded), plain.averages(), why), "after the swap: {}", why);
  step_model(*model, 5);
  plain.update();
  const auto result = sharded.update();
  RANK_CHECK(result.action == emakit::Action::averaged, "update() after the guard ended did not average");
  RANK_CHECK(same(emakit::gather_averages(sharded), plain.averages(), why), "one step after the swap: {}", why);
  // One tensor: the ranks but one hold nothing of the average, and are refused all the same.
  auto single = std::make_shared<torch::nn::Module>();
  single->register_parameter("w", torch::arange(6, torch::kFloat));
  emakit::ShardedEma lone(*single, emakit::Fixed(0.9), {}, {}, emakit::ShardedStorage(group, 20s));
  lone.update();
  const auto single_own = emakit_test::model_snapshot(*single);
  {
    auto swapped = emakit::swap_gathered_into(lone, *single);
    const std::string m = error_of([&] { lone.update(); });
    RANK_CHECK(m == plain_error, "update() during the gathered swap of a rank holding {} bytes: '{}'",
               lone.storage().held_bytes(), m);
  }
  RANK_CHECK(emakit_test::same_snapshot(emakit_test::model_snapshot(*single), single_own),
             "the one-tensor model was not restored");
  RANK_CHECK(lone.calls() == 1, "the refused update counted a call: {}", lone.calls());
  std::printf("rank %d: update() during the gathered swap refused: %s\n", args.rank, plain_error.c_str());
  return 0;
}

// emakit::save / emakit::load of a sharded EMA go through ShardedStorage's checkpoint hooks: the
// folder save_sharded writes, read back by load_sharded's path.
RANK_CASE("save_load_dispatch") {
  auto group = make_group(args);
  Subject s(args, group, "whole", 0);
  s.train(1, 6);
  const auto dir = std::filesystem::path(args.dir) / "via-save";
  emakit::save(*s.sharded, dir);
  Subject fresh(args, group, "whole", 6);
  std::string m = error_of([&] { emakit::load(*fresh.sharded, dir, emakit::LoadMode::lenient); });
  RANK_CHECK(m.find("loads strictly only") != std::string::npos, "{}", m);
  RANK_CHECK(fresh.sharded->step() == 0, "a refused load changed the step to {}", fresh.sharded->step());
  emakit::load(*fresh.sharded, dir);
  std::string why;
  RANK_CHECK(same(emakit::gather_averages(*fresh.sharded), s.plain.averages(), why), "after emakit::load: {}", why);
  RANK_CHECK(fresh.sharded->step() == 6, "step {} after emakit::load", fresh.sharded->step());
  return 0;
}

}  // namespace
#endif
