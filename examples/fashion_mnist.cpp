// What an EMA of the weights buys on real data: a small MLP trained on Fashion-MNIST with
// deliberately noisy SGD (large step, small batches, no momentum), so that the online weights
// jitter around a good solution. The program tracks, during the same run,
//   - a fixed-decay EMA             emakit::FixedEma   (Fixed(0.999))
//   - an inverse-power warmup EMA   emakit::WarmupEma  (InversePowerWarmup, as ema-pytorch)
//   - a post-hoc EMA                emakit::PostHocEma (two power-function profiles, snapshots)
// and, after training, synthesizes post-hoc EMAs for a sweep of sigma_rel values from the one set
// of snapshots, and the fixed and the warmup EMA themselves (their policies as synthesis targets,
// emakit::EmaTarget), beside the live ones. Each is evaluated on the 10k test images: accuracy and
// mean cross-entropy.
//
//   ./scripts/demo.sh                       # installs the data, builds, runs this with defaults
//   emakit_example_fashion_mnist --data build/data/fashion-mnist --out build/demo-out
//   emakit_example_fashion_mnist --epochs 1 --train-subset 6000 --check --quiet --no-plot
//
// Data: the four uncompressed IDX files of Fashion-MNIST (Debian: `apt-get install
// dataset-fashion-mnist`, gzip'd in /usr/share/datasets/fashion-mnist; scripts/demo.sh
// decompresses them into build/data/fashion-mnist), read with torch::data::datasets::MNIST.
//
// Output (in --out): results.csv (one row per model), curve.csv (test loss and accuracy per epoch
// of the online weights and the two EMAs), results.png (gnuplot, unless --no-plot), plot.gp (the
// gnuplot script: `cd <out> && gnuplot plot.gp` redraws it) and phema/ (the post-hoc snapshots;
// emakit_example_posthoc_tool list <out>/phema).
//
// Reproducible for a given seed and thread count: the initialisation comes from
// torch::manual_seed(seed), the shuffling from a std::mt19937_64 seeded with it.
//
// --check: exit 1 unless the fixed and the warmup EMA have a test loss no worse than the online
// weights (0 otherwise); with the data missing it exits 77 (ctest: skipped).
#include <emakit/aliases.hpp>
#include <emakit/format.hpp>
#include <emakit/posthoc.hpp>

#include <ATen/Parallel.h>
#include <torch/data/datasets/mnist.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "subprocess.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kSkipped = 77;  // ctest's SKIP_RETURN_CODE
constexpr int kMissingData = 2;
constexpr int kPixels = 28 * 28;

struct Args {
  int epochs = 6;
  int batch_size = 16;
  double lr = 0.1;
  std::uint64_t seed = 0;
  int threads = 1;  // 0: LibTorch's default
  int hidden = 256;
  std::int64_t train_subset = 0;
  std::string data = "build/data/fashion-mnist";
  std::string out = "build/demo-out";
  double fixed_decay = 0.999;
  double warmup_beta = 0.9999;
  double warmup_power = 2.0 / 3.0;
  std::vector<double> tracked_sigma_rels{0.05, 0.10};
  std::vector<double> sweep_sigma_rels{0.02, 0.04, 0.06, 0.08, 0.10, 0.13, 0.16, 0.20};
  std::int64_t snapshot_every = 0;  // 0: at the end of each epoch
  bool check = false;
  bool no_plot = false;
  bool quiet = false;
};

// ---- the model -------------------------------------------------------------------------------

struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  explicit MlpImpl(int hidden) : hidden(hidden) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(kPixels, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::relu(fc1->forward(x))); }

  int hidden;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

// ---- data ------------------------------------------------------------------------------------

struct Split {
  torch::Tensor x;  // [n, 784] float32, standardised
  torch::Tensor y;  // [n] int64
};

constexpr std::array<const char*, 4> kDataFiles = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                                   "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};

// The first data file that is missing, if any.
std::optional<fs::path> missing_data_file(const fs::path& folder) {
  for (const char* name : kDataFiles) {
    std::error_code ec;
    if (!fs::is_regular_file(folder / name, ec)) return folder / name;
  }
  return std::nullopt;
}

std::pair<Split, Split> load_data(const std::string& root, std::int64_t train_subset) {
  using torch::data::datasets::MNIST;
  const MNIST train(root, MNIST::Mode::kTrain);
  const MNIST test(root, MNIST::Mode::kTest);
  auto train_x = train.images().reshape({-1, kPixels});  // already scaled to [0, 1]
  auto test_x = test.images().reshape({-1, kPixels});
  // Standardise with the statistics of the whole training set.
  const auto mean = train_x.mean().item<double>();
  const auto stddev = train_x.std().item<double>();
  Split tr{(train_x - mean) / stddev, train.targets()};
  Split te{(test_x - mean) / stddev, test.targets()};
  if (train_subset > 0 && train_subset < tr.x.size(0)) {
    tr.x = tr.x.slice(0, 0, train_subset).contiguous();
    tr.y = tr.y.slice(0, 0, train_subset).contiguous();
  }
  return {std::move(tr), std::move(te)};
}

// ---- evaluation ------------------------------------------------------------------------------

struct Score {
  double accuracy = 0;  // in [0, 1]
  double loss = 0;      // mean cross-entropy
};

Score evaluate(Mlp& model, const Split& data) {
  torch::NoGradGuard no_grad;
  const std::int64_t n = data.x.size(0), chunk = 2500;
  double loss_sum = 0;
  std::int64_t correct = 0;
  for (std::int64_t i = 0; i < n; i += chunk) {
    const auto x = data.x.slice(0, i, std::min(n, i + chunk));
    const auto y = data.y.slice(0, i, std::min(n, i + chunk));
    const auto logits = model->forward(x);
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .item<double>();
    correct += logits.argmax(1).eq(y).sum().item<std::int64_t>();
  }
  return {static_cast<double>(correct) / static_cast<double>(n), loss_sum / static_cast<double>(n)};
}

// ---- progress --------------------------------------------------------------------------------

std::string duration_string(double seconds) {
  const auto s = static_cast<long>(std::lround(seconds));
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

class Progress {
 public:
  Progress(bool enabled, int epochs, std::int64_t steps_per_epoch)
      : enabled_(enabled && isatty(STDERR_FILENO) == 1), epochs_(epochs), steps_per_epoch_(steps_per_epoch) {}

  void start_epoch(int epoch) {
    epoch_ = epoch;
    epoch_start_ = Clock::now();
    last_draw_ = {};
  }
  // `step`: steps done in this epoch.
  void tick(std::int64_t step, std::int64_t global_step, double running_loss) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (step != steps_per_epoch_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    const double elapsed = std::chrono::duration<double>(now - epoch_start_).count();
    const double rate = elapsed > 0 ? static_cast<double>(step) / elapsed : 0.0;
    constexpr int width = 24;
    const auto filled = static_cast<int>(width * step / steps_per_epoch_);
    const double eta = rate > 0 ? static_cast<double>(steps_per_epoch_ - step) / rate : 0.0;
    fmt::print(stderr, "\r\x1b[2Kepoch {}/{} [{}{}] step {}/{}  loss {:.4f}  {:.0f} steps/s  epoch eta {}", epoch_,
               epochs_, std::string(filled, '#'), std::string(width - filled, '.'), global_step,
               steps_per_epoch_ * epochs_, running_loss, rate, duration_string(eta));
    std::fflush(stderr);
  }
  // Replaces the bar with a line (or prints the line when there is no bar).
  void line(const std::string& text) const {
    fmt::print(stderr, "{}{}\n", enabled_ ? "\r\x1b[2K" : "", text);
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  int epochs_;
  std::int64_t steps_per_epoch_;
  int epoch_ = 0;
  Clock::time_point epoch_start_{}, last_draw_{};
};

// ---- output ----------------------------------------------------------------------------------

struct Row {
  std::string name;
  Score score;
  std::optional<double> sigma_rel;  // post-hoc rows
};

struct CurvePoint {
  int epoch;
  std::int64_t step;
  Score online, fixed, warmup;
};

// 0.1 -> "0.10" (a column of two-decimal values lines up), 0.025 -> "0.025".
std::string sigma_rel_string(double s) {
  const double hundredths = s * 100.0;
  return std::abs(hundredths - std::round(hundredths)) < 1e-9 ? fmt::format("{:.2f}", s) : fmt::format("{}", s);
}

double change_percent(double loss, double reference) { return 100.0 * (loss / reference - 1.0); }

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw std::runtime_error(fmt::format("cannot write '{}'", path.string()));
}

std::string results_csv(const std::vector<Row>& rows) {
  std::string text = "name,accuracy,loss,loss_change_pct,sigma_rel\n";
  const double reference = rows.front().score.loss;
  for (const auto& r : rows)
    text += fmt::format("{},{:.4f},{:.6f},{:.3f},{}\n", r.name, r.score.accuracy, r.score.loss,
                        change_percent(r.score.loss, reference), r.sigma_rel ? fmt::format("{}", *r.sigma_rel) : "");
  return text;
}

std::string curve_csv(const std::vector<CurvePoint>& curve) {
  std::string text = "epoch,step,online_loss,fixed_loss,warmup_loss,online_accuracy,fixed_accuracy,warmup_accuracy\n";
  for (const auto& p : curve)
    text += fmt::format("{},{},{:.6f},{:.6f},{:.6f},{:.4f},{:.4f},{:.4f}\n", p.epoch, p.step, p.online.loss,
                        p.fixed.loss, p.warmup.loss, p.online.accuracy, p.fixed.accuracy, p.warmup.accuracy);
  return text;
}

// Two panels: test loss per epoch (online and the two EMAs); post-hoc test loss vs sigma_rel, with
// the final losses of the other three as horizontal lines. Reads the CSVs from its own folder.
std::string plot_script(const std::vector<Row>& rows, const std::string& fixed_name, const std::string& warmup_name,
                        int epochs) {
  return fmt::format(
      R"gp(# emakit_example_fashion_mnist: `gnuplot plot.gp` in this folder redraws results.png.
if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {{
  set terminal pngcairo noenhanced size 1400,560 font ",11"
}} else {{
  set terminal png noenhanced size 1400,560
}}
set output "results.png"
set datafile separator ","
set grid
set offsets graph 0.02, graph 0.02, graph 0.05, graph 0.05
online = "#d62728"; fixed = "#1f77b4"; warmup = "#2ca02c"; posthoc = "#000000"
set multiplot layout 1,2 title "Fashion-MNIST, MLP, noisy SGD: test cross-entropy of the online weights and of EMAs"
set title "test loss after each epoch"
set xlabel "epoch"
set ylabel "test loss"
{}
set key top right
plot "curve.csv" using 1:3 skip 1 with linespoints lw 2 pt 7 lc rgb online title "online", \
     "" using 1:4 skip 1 with linespoints lw 2 pt 5 lc rgb fixed title "{}", \
     "" using 1:5 skip 1 with linespoints lw 2 pt 9 lc rgb warmup title "{}"
set title "post-hoc EMAs synthesized at the last step (dashed: final losses of the others)"
set xtics autofreq
set xlabel "sigma_rel of the synthesized EMA"
set key center right
plot "results.csv" using 5:(strcol(5) eq "" ? NaN : $3) skip 1 with linespoints lw 2 pt 7 lc rgb posthoc title "post-hoc EMA", \
     {:.6f} with lines dt 2 lw 2 lc rgb online title "online", \
     {:.6f} with lines dt 2 lw 2 lc rgb fixed title "{}", \
     {:.6f} with lines dt 3 lw 2 lc rgb warmup title "{}"
unset multiplot
)gp",
      epochs <= 20 ? "set xtics 1" : "set xtics autofreq", fixed_name, warmup_name, rows[0].score.loss,
      rows[1].score.loss, fixed_name, rows[2].score.loss, warmup_name);
}

// Runs gnuplot on plot.gp in `out`. Returns a line for the user when no plot was made.
std::optional<std::string> draw_plot(const fs::path& out) {
  const std::string gnuplot = emakit_subprocess::find_program("gnuplot");
  if (gnuplot.empty())
    return "gnuplot is not installed (Debian: sudo apt-get install gnuplot-nox): no plot; the CSVs are there";
  const int status = emakit_subprocess::run({gnuplot, "plot.gp"}, {.cwd = out});
  if (status != 0)
    return fmt::format("gnuplot failed ({}) on {}: no plot", emakit_subprocess::describe(status),
                       (out / "plot.gp").string());
  return std::nullopt;
}

// Removes the post-hoc snapshots of an earlier run (a snapshot folder must hold one run).
std::size_t clear_snapshots(const fs::path& folder) {
  std::size_t removed = 0;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return 0;
  for (const auto& entry : fs::directory_iterator(folder))
    if (emakit::is_snapshot_file_name(entry.path().filename().string()) && fs::remove(entry.path())) ++removed;
  for (const auto& stale : emakit::interrupted_writes(folder))
    if (fs::remove(stale)) ++removed;
  return removed;
}

// ---- the run ---------------------------------------------------------------------------------

int run(const Args& args) {
  const auto t_start = Clock::now();
  if (const auto missing = missing_data_file(args.data)) {
    fmt::print(stderr,
               "{}Fashion-MNIST is missing: no file '{}'.\n"
               "  Install it with `sudo apt-get install dataset-fashion-mnist` (gzip'd files in "
               "/usr/share/datasets/fashion-mnist),\n"
               "  then run `./scripts/demo.sh`, which decompresses them into build/data/fashion-mnist\n"
               "  (or pass --data with a folder holding the four uncompressed files: {}).\n",
               args.check ? "SKIPPED: " : "error: ", missing->string(), fmt::join(kDataFiles, ", "));
    return args.check ? kSkipped : kMissingData;
  }

  torch::manual_seed(args.seed);
  if (args.threads > 0) at::set_num_threads(args.threads);
  auto [train, test] = load_data(args.data, args.train_subset);
  const std::int64_t n_train = train.x.size(0);
  const std::int64_t steps_per_epoch = (n_train + args.batch_size - 1) / args.batch_size;
  const std::int64_t total_steps = steps_per_epoch * args.epochs;

  Mlp model(args.hidden);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(args.lr));  // no momentum

  const fs::path out = args.out;
  const fs::path phema_dir = out / "phema";
  fs::create_directories(out);
  const std::size_t stale = clear_snapshots(phema_dir);

  emakit::FixedEma fixed(*model, emakit::Fixed(args.fixed_decay));
  emakit::WarmupEma warmup(*model, emakit::InversePowerWarmup(args.warmup_beta).power(args.warmup_power));
  emakit::PostHocEma posthoc(
      *model,
      emakit::PostHocOptions(phema_dir).sigma_rels(args.tracked_sigma_rels).snapshot_every(args.snapshot_every));
  const std::string fixed_name = fmt::format("fixed EMA {}", args.fixed_decay);
  const std::string warmup_name = fmt::format("warmup EMA {}", args.warmup_beta);

  std::int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();
  fmt::print("Fashion-MNIST from {}: {} training images{}, {} test images\n", args.data, n_train,
             args.train_subset > 0 ? " (--train-subset)" : "", test.x.size(0));
  fmt::print(
      "MLP {}-{}-10 ({} parameters), SGD lr {} batch {} (no momentum), {} epochs = {} steps, seed {}, {} thread{}\n",
      kPixels, args.hidden, n_params, args.lr, args.batch_size, args.epochs, total_steps, args.seed,
      at::get_num_threads(), at::get_num_threads() == 1 ? "" : "s");
  fmt::print("  {}\n  {}\n  PostHocEma sigma_rels [{}], snapshots {} into {}{}\n", fixed, warmup,
             fmt::join(args.tracked_sigma_rels, ", "),
             args.snapshot_every > 0 ? fmt::format("every {} steps", args.snapshot_every) : "at each epoch's end",
             phema_dir.string(), stale > 0 ? fmt::format(" (removed {} files of an earlier run)", stale) : "");
  std::fflush(stdout);

  Progress progress(!args.quiet, args.epochs, steps_per_epoch);
  std::mt19937_64 rng(args.seed);
  std::vector<std::int64_t> order(static_cast<std::size_t>(n_train));
  for (std::int64_t i = 0; i < n_train; ++i) order[static_cast<std::size_t>(i)] = i;

  std::vector<CurvePoint> curve;
  std::int64_t step = 0;
  bool snapshot_at_last_step = false;
  double train_seconds = 0, eval_seconds = 0;
  for (int epoch = 1; epoch <= args.epochs; ++epoch) {
    // Fisher-Yates with our own generator: the same order with any standard library.
    for (std::size_t i = order.size() - 1; i > 0; --i) std::swap(order[i], order[rng() % (i + 1)]);
    const auto perm = torch::from_blob(order.data(), {n_train}, torch::kInt64);

    progress.start_epoch(epoch);
    const auto t_epoch = Clock::now();
    double running = std::nan(""), epoch_loss = 0;
    for (std::int64_t b = 0; b < steps_per_epoch; ++b) {
      const auto idx = perm.slice(0, b * args.batch_size, std::min(n_train, (b + 1) * args.batch_size));
      const auto x = train.x.index_select(0, idx);
      const auto y = train.y.index_select(0, idx);
      optimizer.zero_grad();
      const auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
      loss.backward();
      optimizer.step();
      ++step;
      fixed.update();
      warmup.update();
      snapshot_at_last_step = posthoc.update().snapshot;

      const double l = loss.item<double>();
      epoch_loss += l;
      running = std::isnan(running) ? l : 0.98 * running + 0.02 * l;
      progress.tick(b + 1, step, running);
    }
    if (args.snapshot_every == 0) {
      posthoc.snapshot();
      snapshot_at_last_step = true;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t_epoch).count();
    train_seconds += seconds;

    const auto t_eval = Clock::now();
    CurvePoint point{epoch, step, evaluate(model, test), {}, {}};
    {
      auto swapped = fixed.swap_into();
      point.fixed = evaluate(model, test);
    }
    {
      auto swapped = warmup.swap_into();
      point.warmup = evaluate(model, test);
    }
    eval_seconds += std::chrono::duration<double>(Clock::now() - t_eval).count();
    curve.push_back(point);
    if (!args.quiet)
      progress.line(fmt::format(
          "epoch {:>2}/{} step {:>6}  train loss {:.4f}  test loss: online {:.4f}, fixed {:.4f}, warmup {:.4f}  "
          "({:.0f} steps/s)",
          epoch, args.epochs, step, epoch_loss / static_cast<double>(steps_per_epoch), point.online.loss,
          point.fixed.loss, point.warmup.loss, static_cast<double>(steps_per_epoch) / seconds));
  }
  if (!snapshot_at_last_step) posthoc.snapshot();  // the sweep synthesizes at the last step

  // ---- post-hoc sweep: every sigma_rel from the same snapshots, at the last step ----
  const auto t_sweep = Clock::now();
  std::vector<Row> rows{{"online", curve.back().online, std::nullopt},
                        {fixed_name, curve.back().fixed, std::nullopt},
                        {warmup_name, curve.back().warmup, std::nullopt}};
  auto copy = std::dynamic_pointer_cast<MlpImpl>(model->clone());
  Mlp synthesized(copy);
  std::vector<std::string> failures;
  for (double sigma_rel : args.sweep_sigma_rels) {
    try {
      const auto plan = posthoc.plan(emakit::SynthesisOptions::from_sigma_rel(sigma_rel));
      emakit::synthesize_into(plan, *synthesized);
      rows.push_back(
          {fmt::format("post-hoc sigma_rel={}", sigma_rel_string(sigma_rel)), evaluate(synthesized, test), sigma_rel});
    } catch (const std::exception& e) {
      failures.push_back(fmt::format("post-hoc sigma_rel={}: {}", sigma_rel, e.what()));
    }
  }
  // The two live EMAs synthesized post hoc from the same snapshots (their policies as targets), with
  // the fit error and the distance of the weights to the live EMA's.
  const auto synthesize_live = [&](const std::string& name, const emakit::EmaTarget& target,
                                   const emakit::StateDict& live) {
    try {
      const auto plan = posthoc.plan(emakit::SynthesisOptions(target));
      const auto result = emakit::synthesize(plan);
      double d2 = 0, n2 = 0;
      for (const auto& item : live) {
        const auto a = item.value().to(torch::kDouble), b = result[item.key()].to(torch::kDouble);
        d2 += (a - b).pow(2).sum().item<double>();
        n2 += a.pow(2).sum().item<double>();
      }
      emakit::synthesize_into(plan, *synthesized);
      rows.push_back({fmt::format("post-hoc {} (fit error {:.2g}, weights {:.2g} from live)", name,
                                  plan.solution.fit_error, std::sqrt(d2 / n2)),
                      evaluate(synthesized, test), std::nullopt});
    } catch (const emakit::SynthesisRefused& e) {  // a short run: the EMA still weighs its start (not a failure)
      fmt::print("post-hoc {}: {}\n", name, e.what());
    } catch (const std::exception& e) {
      failures.push_back(fmt::format("post-hoc {}: {}", name, e.what()));
    }
  };
  synthesize_live(fixed_name, emakit::EmaTarget::of(fixed), fixed.averages());
  synthesize_live(warmup_name, emakit::EmaTarget::of(warmup), warmup.averages());
  const double sweep_seconds = std::chrono::duration<double>(Clock::now() - t_sweep).count();

  // ---- the table ----
  const double reference = rows.front().score.loss;
  std::size_t width = 5;
  for (const auto& r : rows) width = std::max(width, r.name.size());
  fmt::print("\n{:<{}}  {:>9}  {:>9}  {:>10}\n", "model", width, "accuracy", "test loss", "vs online");
  fmt::print("{:-<{}}\n", "", width + 34);
  for (const auto& r : rows) {
    const std::string change =
        &r == &rows.front() ? std::string("") : fmt::format("{:+.1f}%", change_percent(r.score.loss, reference));
    fmt::print("{:<{}}  {:>8.2f}%  {:>9.4f}  {:>10}\n", r.name, width, 100.0 * r.score.accuracy, r.score.loss, change);
  }
  for (const auto& f : failures) fmt::print("{}\n", f);
  const Row* best = &rows.front();
  for (const auto& r : rows)
    if (r.score.loss < best->score.loss) best = &r;
  fmt::print("\nlowest test loss: {} ({:.4f}, {:+.1f}% vs online)\n", best->name, best->score.loss,
             change_percent(best->score.loss, reference));

  // ---- files ----
  write_file(out / "results.csv", results_csv(rows));
  write_file(out / "curve.csv", curve_csv(curve));
  std::vector<std::string> written{(out / "results.csv").string(), (out / "curve.csv").string()};
  if (!args.no_plot) {
    write_file(out / "plot.gp", plot_script(rows, fixed_name, warmup_name, args.epochs));
    written.push_back((out / "plot.gp").string());
    if (const auto why = draw_plot(out))
      fmt::print("{}\n", *why);
    else
      written.push_back((out / "results.png").string());
  }
  const double total_seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  fmt::print(
      "time: {:.1f} s in all: training {:.1f} s ({:.0f} steps/s), evaluation {:.1f} s, post-hoc sweep {:.1f} s\n",
      total_seconds, train_seconds, static_cast<double>(total_steps) / train_seconds, eval_seconds, sweep_seconds);
  fmt::print("wrote {}\n      and {} post-hoc snapshots in {}\n", fmt::join(written, "\n      "),
             emakit::list_snapshots(phema_dir).size(), phema_dir.string());

  if (!failures.empty() && args.check) {
    fmt::print(stderr, "check FAILED: {} post-hoc syntheses failed\n", failures.size());
    return 1;
  }
  if (args.check) {
    const auto& o = rows[0].score;
    std::vector<std::string> worse;
    for (std::size_t i = 1; i <= 2; ++i)
      if (!(rows[i].score.loss <= o.loss))
        worse.push_back(
            fmt::format("{} has test loss {:.4f} > online {:.4f}", rows[i].name, rows[i].score.loss, o.loss));
    if (!worse.empty()) {
      fmt::print(stderr, "check FAILED: {}\n", fmt::join(worse, "; "));
      return 1;
    }
    fmt::print("check passed: {} {:.4f} and {} {:.4f} <= online {:.4f}\n", rows[1].name, rows[1].score.loss,
               rows[2].name, rows[2].score.loss, o.loss);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"Fashion-MNIST with noisy SGD: test loss of the online weights vs a fixed EMA, a warmup EMA and "
               "post-hoc EMAs (emakit)"};
  app.add_option("--epochs", args.epochs, "Training epochs")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", args.batch_size, "Images per SGD step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", args.lr, "SGD learning rate (no momentum)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", args.seed, "Seed of the initialisation and the shuffling")->capture_default_str();
  app.add_option("--threads", args.threads,
                 "Intra-op threads (at::set_num_threads); 0: LibTorch's default. At 16 images per step the "
                 "operations are too small to gain from threads, and OpenMP threads slow to a crawl when "
                 "the cores are busy")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--hidden", args.hidden, "Hidden units of the MLP")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--train-subset", args.train_subset, "Train on the first N training images only; 0: all")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  // --data and --out: the last one given counts (scripts/demo.sh passes both before the user's arguments).
  app.add_option("--data", args.data, "Folder with the four uncompressed Fashion-MNIST IDX files")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->capture_default_str();
  app.add_option("--out", args.out, "Output folder (results.csv, curve.csv, results.png, phema/)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->capture_default_str();
  app.add_option("--fixed-decay", args.fixed_decay, "Decay of the fixed EMA")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--warmup-beta", args.warmup_beta, "Maximum decay (beta) of the inverse-power warmup EMA")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--warmup-power", args.warmup_power, "Power of the inverse-power warmup")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--posthoc-track", args.tracked_sigma_rels, "sigma_rel of the tracked post-hoc profiles (two or more)")
      ->expected(2, 16)
      ->check(CLI::Range(0.001, 0.28))
      ->capture_default_str();
  app.add_option("--posthoc-sweep", args.sweep_sigma_rels, "sigma_rel values synthesized after training")
      ->expected(1, 64)
      ->check(CLI::Range(0.001, 0.28))
      ->capture_default_str();
  app.add_option("--snapshot-every", args.snapshot_every, "Post-hoc snapshot every N steps; 0: at each epoch's end")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--check", args.check,
               "Exit 1 unless the fixed and the warmup EMA have a test loss no worse than the online weights; "
               "77 when the data is missing");
  app.add_flag("--no-plot", args.no_plot, "Do not run gnuplot");
  app.add_flag("--quiet", args.quiet, "No progress bar and no per-epoch lines");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
