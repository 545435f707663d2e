// Data-parallel training with N processes on one machine, the EMA sharded across them
// (emakit::ShardedStorage over a c10d Gloo process group, rendezvous through a c10d::FileStore).
//
//   emakit_example_sharded --ranks 4 --steps 300 [--checkpoint dir]   # train; each rank prints its memory
//   emakit_example_sharded --bench                    # docs/sharding.md's table: 1, 2 and 4 ranks
//
// The program starts its own rank processes (it re-executes itself with --rank). Each rank
// trains the same MLP on its own batches of a synthetic regression task; the gradients are
// averaged with an allreduce, so every rank takes the same optimizer step (DDP). Each rank keeps
// only its share of the EMA; at the end the whole EMA is gathered for evaluation and saved as a
// sharded checkpoint. --bench times update() alone on a larger model for 1, 2 and 4 ranks.
#include <emakit/emakit.hpp>
#include <emakit/gloo.hpp>
#include <emakit/sharded.hpp>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "subprocess.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace std::chrono_literals;

struct MlpImpl : torch::nn::Module {
  MlpImpl(int width, int depth) {
    int in = 16;
    for (int i = 0; i < depth; ++i) {
      layers.push_back(register_module(fmt::format("fc{}", i), torch::nn::Linear(in, width)));
      in = width;
    }
    head = register_module("head", torch::nn::Linear(in, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l->forward(x));
    return head->forward(x);
  }
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Mlp);

// Resident memory of this process in MiB (Linux /proc/self/statm).
double rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return static_cast<double>(pages_resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

struct Args {
  int ranks = 2;
  int steps = 300;
  int width = 256;
  int depth = 8;
  bool bench = false;
  int bench_updates = 50;
  std::string out;
  std::string checkpoint;
  // set for rank processes
  int rank = -1;
  int world = 0;
  std::string store;
};

c10::intrusive_ptr<c10d::ProcessGroup> join(const Args& a) {
  auto store = c10::make_intrusive<c10d::FileStore>(a.store, a.world);
  return emakit::make_gloo_group(store, a.rank, a.world, 60s);
}

// One rank of the training run.
int train_rank(const Args& a) {
  auto group = join(a);
  at::set_num_threads(1);
  torch::manual_seed(0);  // the same initial weights on every rank
  Mlp model(a.width, a.depth);
  const torch::Tensor direction = torch::randn({16}) / 4.0;
  auto target = [&](const torch::Tensor& x) { return torch::sin(x.matmul(direction)).unsqueeze(1); };
  const torch::Tensor x_test = torch::randn({2048, 16});
  const torch::Tensor y_test = target(x_test);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.2));

  emakit::ShardedWarmupEma ema(*model, emakit::InversePowerWarmup(0.995), {}, {}, emakit::ShardedStorage(group, 60s));
  const auto& st = ema.storage();
  std::printf("rank %d/%d: holds %zu of %zu EMA tensors, %.3f of %.3f MiB (%.0f%%); process RSS %.1f MiB\n", a.rank,
              a.world, ema.averages().size(), st.layout().size(), mib(st.held_bytes()), mib(st.total_bytes()),
              100.0 * static_cast<double>(st.held_bytes()) / static_cast<double>(st.total_bytes()), rss_mib());
  std::fflush(stdout);

  torch::manual_seed(100 + a.rank);  // each rank its own batches
  for (int step = 1; step <= a.steps; ++step) {
    const torch::Tensor x = torch::randn({64, 16});
    const torch::Tensor y = target(x) + 0.3 * torch::randn({64, 1});
    optimizer.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    {  // DDP: average the gradients over the ranks, one allreduce of all of them
      std::vector<at::Tensor> grads;
      for (auto& p : model->parameters()) grads.push_back(p.grad().reshape({-1}));
      std::vector<at::Tensor> flat{torch::cat(grads)};
      group->allreduce(flat)->wait();
      flat[0].div_(a.world);
      std::int64_t at = 0;
      for (auto& p : model->parameters()) {
        p.grad().copy_(flat[0].narrow(0, at, p.numel()).view_as(p.grad()));
        at += p.numel();
      }
    }
    optimizer.step();
    ema.update();  // local: this rank's share only, no communication
  }

  auto loss = [&] {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(model->forward(x_test), y_test).item<double>();
  };
  const double online = loss();
  double averaged = 0;
  {
    auto swapped = emakit::swap_gathered_into(ema, *model);  // collective: the whole EMA on every rank
    averaged = loss();
  }
  if (a.rank == 0)
    std::printf("after %d steps on %d ranks: test loss online %.5f, EMA %.5f\n", a.steps, a.world, online, averaged);
  if (!a.checkpoint.empty()) {
    emakit::save_sharded(ema, a.checkpoint);  // collective: one file per rank and an index
    if (a.rank == 0) std::printf("sharded checkpoint in %s\n", a.checkpoint.c_str());
  }
  return 0;
}

// One rank of the benchmark: update() timed alone, on a model of `depth` layers width x width.
int bench_rank(const Args& a) {
  auto group = join(a);
  at::set_num_threads(1);
  torch::manual_seed(0);
  Mlp model(a.width, a.depth);
  emakit::ShardedEma ema(*model, emakit::Fixed(0.999), {}, {}, emakit::ShardedStorage(group, 60s));
  const auto& st = ema.storage();
  // The ranks take turns (a barrier before each), so that each is timed alone: this is the update
  // time of a rank with a core of its own, not of N processes sharing a small machine.
  std::vector<double> ms;
  for (int turn = 0; turn < a.world; ++turn) {
    (void)st.exchange({0}, "bench barrier");
    if (turn != a.rank) continue;
    for (int i = 0; i < a.bench_updates + 5; ++i) {
      {
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.add_(1e-3);
      }
      const auto t0 = std::chrono::steady_clock::now();
      ema.update();
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= 5) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const auto rows = st.exchange({st.held_bytes(), static_cast<std::int64_t>(median * 1000.0)}, "bench");
  const auto t0 = std::chrono::steady_clock::now();
  const auto full = emakit::gather_averages(ema, 0);
  const double gather_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (a.rank == 0) {
    std::int64_t max_bytes = 0, max_us = 0;
    for (const auto& r : rows) {
      max_bytes = std::max(max_bytes, r[0]);
      max_us = std::max(max_us, r[1]);
    }
    std::ofstream out(a.out, std::ios::app);
    out << fmt::format("| {} | {:.1f} | {:.1f} | {:.2f} | {:.1f} |\n", a.world, mib(st.total_bytes()), mib(max_bytes),
                       static_cast<double>(max_us) / 1000.0, gather_ms);
  }
  return 0;
}

// Starts `world` copies of this program as ranks and waits for them; 0 when all succeeded.
int run_ranks(const Args& a, int world, const std::vector<std::string>& extra) {
  char tmpl[] = "/tmp/emakit-sharded-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (dir == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string store = std::string(dir) + "/store";
  std::vector<emakit_subprocess::Process> ranks;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args{"/proc/self/exe",
                                  "--rank",
                                  std::to_string(r),
                                  "--world",
                                  std::to_string(world),
                                  "--store",
                                  store,
                                  "--steps",
                                  std::to_string(a.steps),
                                  "--width",
                                  std::to_string(a.width),
                                  "--depth",
                                  std::to_string(a.depth)};
    if (!a.checkpoint.empty())
      args.insert(args.end(), {"--checkpoint", std::filesystem::absolute(a.checkpoint).string()});
    args.insert(args.end(), extra.begin(), extra.end());
    ranks.emplace_back(std::move(args));
  }
  int failed = 0;
  for (auto& rank : ranks) failed += rank.wait() != 0;
  std::filesystem::remove_all(dir);
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Data-parallel training with the EMA sharded across N processes (Gloo on loopback)"};
  app.add_option("--ranks", a.ranks, "number of rank processes")->check(CLI::Range(1, 64));
  app.add_option("--steps", a.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--width", a.width, "hidden width")->check(CLI::PositiveNumber);
  app.add_option("--depth", a.depth, "hidden layers")->check(CLI::PositiveNumber);
  app.add_option("--checkpoint", a.checkpoint, "save the EMA there as a sharded checkpoint at the end");
  app.add_flag("--bench", a.bench, "time update() and count bytes per rank for 1, 2 and 4 ranks");
  app.add_option("--bench-updates", a.bench_updates, "timed updates per rank in --bench")->check(CLI::PositiveNumber);
  app.add_option("--out", a.out, "(internal) where a bench rank appends its table row");
  app.add_option("--rank", a.rank, "(internal) this process's rank");
  app.add_option("--world", a.world, "(internal) number of ranks");
  app.add_option("--store", a.store, "(internal) the FileStore's file");
  CLI11_PARSE(app, argc, argv);

  try {
    if (a.rank >= 0) {
      const int code = a.bench ? bench_rank(a) : train_rank(a);
      std::fflush(stdout);
      std::_Exit(code);
    }
    if (!a.bench) return run_ranks(a, a.ranks, {});
    if (!app.count("--width")) a.width = 2048;
    if (!app.count("--depth")) a.depth = 16;
    const std::string table =
        (std::filesystem::temp_directory_path() / fmt::format("emakit-bench-{}.md", ::getpid())).string();
    std::filesystem::remove(table);
    for (int world : {1, 2, 4})
      if (run_ranks(a, world, {"--bench", "--bench-updates", std::to_string(a.bench_updates), "--out", table}) != 0)
        return 1;
    fmt::print(
        "ShardedEma update() on an MLP of {} layers {}x{} (fp32), one thread per rank, ranks timed one at a time, "
        "median of {} updates\n\n",
        a.depth, a.width, a.width, a.bench_updates);
    fmt::print("| ranks | whole EMA (MiB) | EMA per rank, max (MiB) | update per rank, max of medians (ms) | gather to "
               "rank 0 (ms) |\n");
    fmt::print("|---|---|---|---|---|\n");
    std::ifstream in(table);
    fmt::print("{}", std::string(std::istreambuf_iterator<char>(in), {}));
    std::filesystem::remove(table);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", a.rank, e.what());
    std::fflush(stderr);
    std::_Exit(1);
  }
}
