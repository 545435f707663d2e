// Post-hoc EMA: the EDM2 solve, the tracked profile, snapshot files (format, atomicity under a
// real kill, corruption), synthesis (exactness, reconstruction on a training trajectory, errors).
#include <emakit/emakit.hpp>
#include <emakit/posthoc.hpp>

#include "../examples/subprocess.hpp"
#include "helpers.hpp"
#include "skip.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <linux/fs.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace test_posthoc {  // this file's names (unity batches: tests/CMakeLists.txt)

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

// A fresh, empty folder under the system's temporary folder, removed at the end of the scope.
struct TempFolder {
  fs::path path;
  explicit TempFolder(const std::string& name) {
    path = fs::temp_directory_path() / fmt::format("emakit-test-{}-{}", name, static_cast<long>(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Relative L2 distance between two state dicts over their floating tensors.
double distance(const emakit::StateDict& a, const emakit::StateDict& b) {
  double d = 0, n = 0;
  for (const auto& item : a) {
    if (!item.value().is_floating_point()) continue;
    const auto x = item.value().to(torch::kDouble), y = b[item.key()].to(torch::kDouble);
    d += (x - y).pow(2).sum().item<double>();
    n += y.pow(2).sum().item<double>();
  }
  return std::sqrt(d / n);
}
double distance_between(const emakit::StateDict& a, const emakit::StateDict& b) {
  double d = 0;
  for (const auto& item : a)
    if (item.value().is_floating_point())
      d += (item.value().to(torch::kDouble) - b[item.key()].to(torch::kDouble)).pow(2).sum().item<double>();
  return std::sqrt(d);
}

// One named float64 tensor the tests set by hand at every step.
struct Scalars {
  torch::Tensor x = torch::zeros({3}, torch::kDouble);
  std::vector<emakit::SourceTensor> sources() const { return {{"x", x, false}}; }
  void set(double s) { x.copy_(torch::tensor({s, std::sin(s), s * s / 100.0}, torch::kDouble)); }
};

}  // namespace

TEST_CASE("The EDM2 coefficients of DESIGN.md are reproduced to 1e-9", "[posthoc]") {
  std::vector<emakit::Profile> snapshots;
  for (double t : {1000.0, 2000.0, 3000.0, 4000.0})
    for (double sigma_rel : {0.05, 0.10}) snapshots.push_back({t, emakit::sigma_rel_to_gamma(sigma_rel)});
  const auto solution = emakit::solve_posthoc_weights(snapshots, {4000.0, emakit::sigma_rel_to_gamma(0.07)});
  const std::vector<double> reference = {1.8701727e-08, -4.5939871e-07, 8.3507393e-05, -5.6804806e-04,
                                         1.0685739e-02, -4.3921236e-02, 4.3456714e-01, 5.9915334e-01};
  REQUIRE(solution.weights.size() == reference.size());
  double sum = 0;
  for (std::size_t i = 0; i < reference.size(); ++i) {
    INFO("weight " << i);
    // The reference has 8 significant digits: compare to 1e-9 absolute and to its last digit.
    CHECK(solution.weights[i] == Approx(reference[i]).margin(1e-9).epsilon(1e-7));
    sum += solution.weights[i];
  }
  CHECK(sum == Approx(1.0).margin(1e-14));
  CHECK(solution.raw_sum == Approx(1.0114592289).epsilon(1e-9));  // EDM2 normalises; ema-pytorch does not
  CHECK(solution.condition > 1.0);
  CHECK(solution.condition < 1e3);
}

TEST_CASE("The profile inner product is the L2 product of two power-function profiles", "[posthoc]") {
  // Midpoint rule over [0, max(t)] against the closed form, for profiles on either side.
  auto profile = [](emakit::Profile p, double tau) {
    return tau <= p.t ? (p.gamma + 1.0) * std::pow(tau, p.gamma) / std::pow(p.t, p.gamma + 1.0) : 0.0;
  };
  const emakit::Profile a{3.0, 6.94}, b{5.0, 1.83}, c{5.0, 16.97};
  for (auto [p, q] : {std::pair{a, b}, std::pair{b, a}, std::pair{b, c}, std::pair{a, a}}) {
    const int n = 400000;
    const double top = std::max(p.t, q.t), h = top / n;
    double integral = 0;
    for (int i = 0; i < n; ++i) integral += profile(p, (i + 0.5) * h) * profile(q, (i + 0.5) * h) * h;
    INFO("t_a " << p.t << ", gamma_a " << p.gamma << ", t_b " << q.t << ", gamma_b " << q.gamma);
    CHECK(emakit::profile_inner_product(p, q) == Approx(integral).epsilon(1e-6));
    CHECK(emakit::profile_inner_product(p, q) == Approx(emakit::profile_inner_product(q, p)).epsilon(1e-14));
  }
}

TEST_CASE("sigma_rel and gamma round-trip through the post-hoc options", "[posthoc]") {
  const std::vector<double> sigma_rels = {0.01, 0.05, 0.07, 0.10, 0.15, 0.20, 0.28};
  const auto options = emakit::PostHocOptions("unused").sigma_rels(sigma_rels);
  REQUIRE(options.sigma_rels().size() == sigma_rels.size());
  for (std::size_t i = 0; i < sigma_rels.size(); ++i) {
    CHECK(options.sigma_rels()[i] == Approx(sigma_rels[i]).margin(1e-13));
    CHECK(emakit::gamma_to_sigma_rel(options.gammas()[i]) == Approx(sigma_rels[i]).margin(1e-13));
    const auto target = emakit::SynthesisOptions::from_sigma_rel(sigma_rels[i]);
    CHECK(target.sigma_rel() == Approx(sigma_rels[i]).margin(1e-13));
    CHECK(emakit::SynthesisOptions(target.gamma()).sigma_rel() == Approx(sigma_rels[i]).margin(1e-13));
  }
  const auto by_gamma = emakit::PostHocOptions("unused").gammas({16.9721986023, 6.9372039376});
  CHECK(by_gamma.sigma_rels()[0] == Approx(0.05).margin(1e-11));
  CHECK(by_gamma.sigma_rels()[1] == Approx(0.10).margin(1e-11));
}

TEST_CASE("Each tracked EMA is exactly the power-function profile, with update_every and gaps", "[posthoc]") {
  TempFolder folder("profile");
  Scalars model;
  model.set(0);
  const std::int64_t dt = 3;
  emakit::PostHocEma posthoc(
      model.sources(), emakit::PostHocOptions(folder.path).gammas({6.94, 1.83}).update_every(dt).snapshot_every(0));
  // Steps 3, 6, 12, 15, ..., 30: step 9 never reached the EMA (the trainer skipped it).
  std::vector<std::int64_t> steps;
  for (std::int64_t s = dt; s <= 30; s += dt)
    if (s != 9) steps.push_back(s);
  for (auto s : steps) {
    model.set(static_cast<double>(s));
    const auto r = posthoc.update({.step = s});
    CHECK(r.action == (s == dt ? emakit::Action::copied : emakit::Action::averaged));
  }
  for (std::size_t i = 0; i < posthoc.size(); ++i) {
    const double g = posthoc.ema(i).decay_policy().gamma();
    // Weight of the model at step s: (s^(g+1) - prev^(g+1)) / T^(g+1), prev = the previous update's step.
    torch::Tensor expected = torch::zeros({3}, torch::kDouble);
    std::int64_t previous = 0;
    for (auto s : steps) {
      const double w = (std::pow(s, g + 1) - std::pow(previous, g + 1)) / std::pow(30.0, g + 1);
      expected += w * torch::tensor({double(s), std::sin(double(s)), double(s * s) / 100.0}, torch::kDouble);
      previous = s;
    }
    INFO("gamma " << g);
    CHECK(torch::allclose(posthoc.ema(i).average("x"), expected, 1e-12, 0));
  }
}

TEST_CASE("Snapshots: one file per profile, every snapshot_every steps, the header and tensors as tracked",
          "[posthoc][snapshot]") {
  TempFolder folder("snapshots");
  torch::manual_seed(1);
  emakit_test::TinyNet model;
  emakit::PostHocEma posthoc(*model, emakit::PostHocOptions(folder.path).update_every(2).snapshot_every(4),
                             emakit::EmaOptions().copy_only({"fc.bias"}));
  std::vector<bool> written;
  for (int s = 1; s <= 9; ++s) {
    emakit_test::perturb(*model);
    model->bn->num_batches_tracked.fill_(s);
    written.push_back(posthoc.update().snapshot);
  }
  CHECK(written == std::vector<bool>{false, false, false, true, false, false, false, true, false});
  const auto listed = emakit::list_snapshots(folder.path);
  REQUIRE(listed.size() == 4);
  CHECK(listed[0].path.filename() == "phema-0000000004-1.emkit");  // t = 4, sigma_rel 0.10 (smaller gamma) ...
  CHECK(listed[3].path.filename() == "phema-0000000008-0.emkit");  // ... sorted by (t, gamma)
  for (const auto& info : listed) {
    CHECK(info.step == info.t);
    CHECK(info.update_every == 2);
    CHECK(info.sigma_rel == Approx(info.profile == 0 ? 0.05 : 0.10).margin(1e-12));
    CHECK(info.gamma == posthoc.ema(info.profile).decay_policy().gamma());
  }
  const auto last = emakit::load_snapshot(listed[3].path);
  const auto averages = posthoc.ema(0).averages();
  REQUIRE(last.size() == averages.size());
  // The step-9 update was skipped (update_every 2), so the EMA still equals the step-8 snapshot.
  for (const auto& item : averages) CHECK(emakit_test::bitwise_equal(last[item.key()], item.value()));
  CHECK(last["bn.num_batches_tracked"].item<std::int64_t>() == 8);
  const auto info = emakit::read_snapshot_info(listed[3].path);
  REQUIRE(info.tensors.size() == last.size());  // the loop below sees every tensor
  for (const auto& t : info.tensors) CHECK(t.averaged == (t.name != "bn.num_batches_tracked" && t.name != "fc.bias"));
  // A copied tensor is synthesized as its latest value, not mixed across snapshot times.
  const auto synthesized = emakit::synthesize(posthoc.plan(emakit::SynthesisOptions::from_sigma_rel(0.07)));
  CHECK(emakit_test::bitwise_equal(synthesized["fc.bias"], last["fc.bias"]));
  CHECK(emakit::interrupted_writes(folder.path).empty());

  // On demand, at a step that is no multiple of snapshot_every: t is the step of the last update.
  const auto files = posthoc.snapshot();
  REQUIRE(files.size() == 2);
  CHECK(emakit::read_snapshot_info(files[1]).step == 9);
  CHECK(emakit::read_snapshot_info(files[1]).t == 8);
}

TEST_CASE("Snapshot files hold 64-bit steps and lower-precision copies on request", "[posthoc][snapshot]") {
  TempFolder folder("format");
  emakit::StateDict tensors;
  tensors.insert("w", torch::randn({5, 7}));
  tensors.insert("count", torch::tensor({3}, torch::kLong));
  emakit::SnapshotInfo header;
  header.step = header.t = 5'000'000'123;  // past 2^32
  header.gamma = 6.94;
  emakit::write_snapshot(folder.path / "a.emkit", header, tensors, torch::kBFloat16);
  const auto info = emakit::read_snapshot_info(folder.path / "a.emkit");
  CHECK(info.step == 5'000'000'123);
  CHECK(info.t == 5'000'000'123);
  CHECK(info.sigma_rel == Approx(emakit::gamma_to_sigma_rel(6.94)).epsilon(1e-15));
  REQUIRE(info.tensors.size() == 2);
  CHECK(info.tensors[0].stored_dtype == torch::kBFloat16);
  CHECK(info.tensors[0].dtype == torch::kFloat);
  CHECK(info.tensors[1].stored_dtype == torch::kLong);  // copied tensors keep their dtype
  CHECK(info.tensors[0].offset % 64 == 0);
  const auto loaded = emakit::load_snapshot(folder.path / "a.emkit");
  CHECK(torch::equal(loaded["w"], tensors["w"].to(torch::kBFloat16)));
  CHECK(torch::equal(loaded["count"], tensors["count"]));
  // Half the bytes of the float32 data.
  CHECK(info.tensors[0].nbytes == 5 * 7 * 2);
}

TEST_CASE("The snapshot checksum is CRC-32 (zlib's)", "[posthoc][snapshot]") {
  const std::string check = "123456789";
  CHECK(emakit::detail::crc32(check.data(), check.size()) == 0xCBF43926U);
  // Slicing-by-8 and the byte loop agree, also when continued.
  std::string long_text(1000, '\0');
  for (std::size_t i = 0; i < long_text.size(); ++i) long_text[i] = static_cast<char>(i * 7 + 3);
  std::uint32_t bytewise = 0;
  for (char c : long_text) bytewise = emakit::detail::crc32(&c, 1, bytewise);
  CHECK(emakit::detail::crc32(long_text.data(), long_text.size()) == bytewise);
}

TEST_CASE("A corrupt, truncated or foreign snapshot is rejected with an error naming the file",
          "[posthoc][snapshot][errors]") {
  TempFolder folder("corrupt");
  torch::manual_seed(2);
  emakit_test::TinyNet model;
  emakit::PostHocEma posthoc(*model, emakit::PostHocOptions(folder.path).snapshot_every(2));
  for (int s = 1; s <= 4; ++s) {
    emakit_test::perturb(*model);
    posthoc.update();
  }
  const fs::path good = folder.path / "phema-0000000004-1.emkit";
  const auto bytes = read_bytes(good);
  const auto info = emakit::read_snapshot_info(good);
  const auto& weight = info.tensors.front();  // fc.weight
  const fs::path bad = folder.path / "phema-0000000099-7.emkit";
  // A damaged file is a std::runtime_error; another format version, the one error every
  // format's reader throws for it (emakit::FormatVersionError).
  auto rejected = [&](const std::vector<char>& content, const std::string& why, bool header_ok = false,
                      bool version_error = false) {
    write_bytes(bad, content);
    INFO(why);
    if (header_ok) {
      CHECK_NOTHROW(emakit::read_snapshot_info(bad));
    } else if (version_error) {
      CHECK_THROWS_AS(emakit::read_snapshot_info(bad), emakit::FormatVersionError);
      CHECK_THROWS_WITH(emakit::list_snapshots(folder.path), Contains(bad.string()) && Contains(why));
    } else {
      CHECK_THROWS_AS(emakit::read_snapshot_info(bad), std::runtime_error);
      CHECK_THROWS_WITH(emakit::list_snapshots(folder.path), Contains(bad.string()) && Contains(why));
    }
    CHECK_THROWS_WITH(emakit::load_snapshot(bad), Contains(bad.string()) && Contains(why));
  };
  auto flipped_data = bytes;
  flipped_data[weight.offset + 5] ^= 0x10;
  rejected(flipped_data, "tensor 'fc.weight' fails the CRC-32 check", true);
  auto flipped_header = bytes;
  flipped_header[20] ^= 0x01;  // inside the step field
  rejected(flipped_header, "header fails the CRC-32 check");
  rejected(std::vector<char>(bytes.begin(), bytes.end() - 3), "is truncated");
  rejected(std::vector<char>(bytes.begin(), bytes.begin() + 40), "is truncated");
  rejected(std::vector<char>(bytes.begin(), bytes.begin() + 10), "is truncated");
  {
    // 40 bytes whose preamble claims a header of 1 GiB - 1: refused against the file's size, before
    // a buffer of that size is made (a 1 GiB buffer, zero-filled, would lift the peak resident
    // size, reset here to the present size, by 1 GiB).
    auto claims = std::vector<char>(bytes.begin(), bytes.begin() + 40);
    const std::uint32_t huge = (1U << 30) - 1;
    std::memcpy(claims.data() + 12, &huge, 4);
    REQUIRE(emakit_test::reset_peak_resident());
    const long peak_before_kib = emakit_test::peak_resident_kib();
    REQUIRE(peak_before_kib > 0);
    rejected(claims,
             "is truncated: 40 bytes, shorter than its " + std::to_string(16 + std::size_t{huge} + 4) + "-byte header");
    CHECK(emakit_test::peak_resident_kib() - peak_before_kib < 256 * 1024);
  }
  auto foreign = bytes;
  foreign[0] = 'P';
  rejected(foreign, "is not an emakit snapshot file");
  CHECK_THROWS_WITH(emakit::load_snapshot(folder.path),
                    Contains(folder.path.string()) && Contains("is a directory, not a snapshot file"));
  CHECK_THROWS_WITH(emakit::read_snapshot_info(folder.path / "none.emkit"),
                    Contains("none.emkit") && Contains("No such file or directory"));
  auto future = bytes;
  future[8] = 3;
  rejected(future,
           "emakit post-hoc snapshot version 3; this emakit (" + std::string(emakit::version_string) +
               ") reads versions 1 to 2; a newer emakit wrote it: update emakit",
           false, true);

  // A synthesis that would read the corrupt tensor fails and writes no output.
  write_bytes(bad, flipped_data);
  fs::rename(bad, good);
  const auto plan = emakit::plan_synthesis(folder.path, emakit::SynthesisOptions::from_sigma_rel(0.07));
  const fs::path out = folder.path / "out" / "ema.pt";
  fs::create_directories(out.parent_path());
  CHECK_THROWS_WITH(emakit::synthesize_to_file(plan, out), Contains(good.string()) && Contains("CRC-32"));
  CHECK_THROWS_WITH(emakit::synthesize_to_file(plan, out, emakit::OutputFormat::snapshot), Contains(good.string()));
  CHECK(fs::is_empty(out.parent_path()));
  CHECK_THROWS_WITH(emakit::synthesize(plan), Contains(good.string()));
}

TEST_CASE("Snapshots of another model are rejected naming the file and the tensor", "[posthoc][errors]") {
  TempFolder folder("foreign");
  torch::manual_seed(3);
  emakit_test::TinyNet model;
  emakit::PostHocEma posthoc(*model, emakit::PostHocOptions(folder.path).snapshot_every(2));
  for (int s = 1; s <= 2; ++s) posthoc.update();
  auto tensors = emakit::load_snapshot(folder.path / "phema-0000000002-0.emkit");
  emakit::SnapshotInfo header;
  header.step = header.t = 4;
  header.gamma = 3.0;
  header.run = posthoc.run();  // the same run: the model check is what refuses it
  const auto options = emakit::SynthesisOptions::from_sigma_rel(0.07);

  tensors["fc.weight"] = torch::zeros({5, 3});
  emakit::write_snapshot(folder.path / "phema-0000000004-0.emkit", header, tensors);
  CHECK_THROWS_WITH(
      emakit::plan_synthesis(folder.path, options),
      Contains("phema-0000000004-0.emkit' is of another model") && Contains("'fc.weight' has shape [5, 3]"));

  emakit::StateDict fewer;
  fewer.insert("fc.weight", torch::zeros({4, 3}));
  emakit::write_snapshot(folder.path / "phema-0000000004-0.emkit", header, fewer);
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, options),
                    Contains("of another model") && Contains("no tensor 'fc.bias'"));

  // A module that lacks a tensor of the snapshots.
  fs::remove(folder.path / "phema-0000000004-0.emkit");
  torch::nn::Linear other(3, 4);
  CHECK_THROWS_WITH(emakit::synthesize_into(emakit::plan_synthesis(folder.path, options), *other),
                    Contains("no tensor 'fc.weight'") && Contains("phema-0000000002-"));
}

TEST_CASE("Bad post-hoc options are errors at construction naming the value", "[posthoc][errors]") {
  using emakit::PostHocOptions;
  CHECK_THROWS_AS(PostHocOptions("x").sigma_rels({0.05, 0.3}), std::invalid_argument);
  CHECK_THROWS_WITH(PostHocOptions("x").sigma_rels({0.05, 0.3}),
                    Contains("sigma_rel") && Contains("0.3") && Contains("(0, 0.2887)"));
  CHECK_THROWS_WITH(PostHocOptions("x").sigma_rels({0.0, 0.1}), Contains("got 0"));
  CHECK_THROWS_WITH(PostHocOptions("x").sigma_rels({0.1}), Contains("at least two") && Contains("got 1 ([0.1])"));
  CHECK_THROWS_WITH(PostHocOptions("x").sigma_rels({0.1, 0.05, 0.1}), Contains("0.1 appears twice"));
  CHECK_THROWS_WITH(PostHocOptions("x").gammas({-1.0, 3.0}),
                    Contains("PostHocOptions::gammas: each gamma must be > 0, got -1"));
  CHECK_THROWS_WITH(PostHocOptions("x").update_every(0), Contains("PostHocOptions::update_every must be > 0, got 0"));
  CHECK_THROWS_WITH(PostHocOptions("x").snapshot_every(-5),
                    Contains("PostHocOptions::snapshot_every must be >= 0, got -5"));
  CHECK_THROWS_WITH(PostHocOptions("x").snapshot_dtype(torch::kLong), Contains("snapshot_dtype"));
  CHECK_THROWS_WITH(PostHocOptions(""), Contains("folder"));
  CHECK_THROWS_WITH(emakit::SynthesisOptions::from_sigma_rel(0.29), Contains("sigma_rel") && Contains("0.29"));
  CHECK_THROWS_WITH(emakit::SynthesisOptions(0.0), Contains("SynthesisOptions: gamma must be > 0, got 0"));
  CHECK_THROWS_WITH(emakit::SynthesisOptions(7.0).step(0), Contains("SynthesisOptions::step must be > 0, got 0"));
  CHECK_THROWS_WITH(emakit::SynthesisOptions(7.0).max_condition(0.5),
                    Contains("SynthesisOptions::max_condition must be >= 1, got 0.5"));

  TempFolder folder("options");
  emakit_test::TinyNet model;
  CHECK_THROWS_WITH(emakit::PostHocEma(*model, PostHocOptions(folder.path).update_every(100).snapshot_every(250)),
                    Contains("snapshot_every (250) must be a multiple of update_every (100)"));
  emakit::PostHocEma posthoc(*model, PostHocOptions(folder.path).update_every(2));
  CHECK_THROWS_WITH(posthoc.snapshot(), Contains("before the first update"));
}

TEST_CASE("Synthesis errors: no snapshot before the target, not a snapshot time, duplicates, ill-conditioned",
          "[posthoc][errors]") {
  TempFolder folder("synthesis-errors");
  Scalars model;
  model.set(1);
  emakit::PostHocEma posthoc(model.sources(), emakit::PostHocOptions(folder.path).snapshot_every(10));
  for (int s = 1; s <= 30; ++s) {
    model.set(s);
    posthoc.update();
  }
  auto options = emakit::SynthesisOptions::from_sigma_rel(0.07);
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, options.step(5)),
                    Contains("no snapshot at or before step 5") && Contains("earliest is at step 10"));
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, options.step(25)),
                    Contains("step 25 is not a snapshot time") && Contains("step 20 and step 30"));
  const auto plan = emakit::plan_synthesis(folder.path, options.step(20));
  CHECK(plan.snapshots.size() == 4);  // t <= 20 only
  for (const auto& s : plan.snapshots) CHECK(s.t <= 20);

  TempFolder empty("synthesis-empty");
  CHECK_THROWS_WITH(emakit::plan_synthesis(empty.path, options),
                    Contains(empty.path.string()) && Contains("no snapshot"));
  CHECK_THROWS_WITH(emakit::plan_synthesis(empty.path / "missing", options), Contains("does not exist"));

  // The same profile twice (two runs in one folder).
  fs::copy_file(folder.path / "phema-0000000010-0.emkit", folder.path / "phema-0000000010-5.emkit");
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, options.step(30)), Contains("phema-0000000010-0.emkit") &&
                                                                               Contains("phema-0000000010-5.emkit") &&
                                                                               Contains("same profile"));

  // Profiles that (almost) coincide: the condition number is reported.
  const std::vector<emakit::Profile> close = {{10, 6.94}, {10, 6.94 + 1e-7}, {20, 6.94}, {20, 6.94 + 1e-7}};
  CHECK_THROWS_AS(emakit::solve_posthoc_weights(close, {20, 3.0}), emakit::SynthesisRefused);
  CHECK_THROWS_WITH(emakit::solve_posthoc_weights(close, {20, 3.0}),
                    Contains("ill-conditioned: condition number") && Contains("> 1e+12"));
  CHECK_THROWS_WITH(emakit::solve_posthoc_weights(std::vector<emakit::Profile>{{10, 6.94}, {10, 6.94}}, {10, 3.0}),
                    Contains("condition number inf"));
  CHECK_NOTHROW(emakit::solve_posthoc_weights(close, {20, 3.0}, 1e30));
}

TEST_CASE("Synthesizing a tracked profile at a snapshot time gives that snapshot back", "[posthoc][synthesis]") {
  TempFolder folder("identity");
  torch::manual_seed(4);
  emakit_test::TinyNet model;
  emakit::PostHocEma posthoc(*model,
                             emakit::PostHocOptions(folder.path).sigma_rels({0.05, 0.10, 0.15}).snapshot_every(5));
  for (int s = 1; s <= 20; ++s) {
    emakit_test::perturb(*model);
    posthoc.update();
  }
  const auto plan = posthoc.plan(emakit::SynthesisOptions(posthoc.ema(1).decay_policy().gamma()));
  REQUIRE(plan.snapshots.size() == 12);
  for (std::size_t i = 0; i < plan.snapshots.size(); ++i) {
    const bool it = plan.snapshots[i].t == 20 && plan.snapshots[i].profile == 1;
    CHECK(plan.solution.weights[i] == Approx(it ? 1.0 : 0.0).margin(1e-9));
  }
  const auto synthesized = emakit::synthesize(plan);
  const auto tracked = posthoc.ema(1).averages();
  // The synthesis sums w_i * s_i in double and rounds once to fp32; s_k (t = 20, profile 1) is the
  // tracked average itself (fp32 snapshots). So |synthesized - tracked| <= sum_i |w_i - [i = k]| |s_i|
  // (the solver's residue) + the double sum's roundings (a product and a sum per term, each 2^-53
  // of at most sum_i |w_i s_i|, |w_i| <= 1 + 1e-9) + 1/2 ulp of the fp32 result (|got| 2^-24).
  std::vector<emakit::StateDict> snapshots;
  for (const auto& s : plan.snapshots) snapshots.push_back(emakit::load_snapshot(s.path));
  std::size_t compared = 0;
  for (const auto& item : tracked) {
    INFO(item.key());
    const auto& got = synthesized[item.key()];
    CHECK(got.scalar_type() == item.value().scalar_type());
    if (!got.is_floating_point()) {
      CHECK(torch::equal(got, item.value()));
      continue;
    }
    auto bound = torch::zeros(got.sizes(), torch::kDouble);
    for (std::size_t i = 0; i < plan.snapshots.size(); ++i) {
      const bool it = plan.snapshots[i].t == 20 && plan.snapshots[i].profile == 1;
      const double residue = std::abs(plan.solution.weights[i] - (it ? 1.0 : 0.0)) +
                             2.0 * static_cast<double>(plan.snapshots.size()) * (1 + 1e-9) * std::ldexp(1.0, -53);
      bound += residue * snapshots[i][item.key()].to(torch::kDouble).abs();
    }
    const auto half_ulp = got.to(torch::kDouble).abs() * std::ldexp(1.0, -24) + std::ldexp(1.0, -150);
    const auto excess = (got.to(torch::kDouble) - item.value().to(torch::kDouble)).abs() - bound - half_ulp;
    CHECK(excess.max().item<double>() <= 0);
    compared += 1;
  }
  CHECK(compared >= 4);  // fc.weight, fc.bias, bn.weight, bn.bias, the BatchNorm running stats
}

namespace {

// A small regression MLP and a noisy training run: the trajectory the reconstruction test averages.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

}  // namespace

TEST_CASE("A synthesized EMA matches the directly tracked EMA on a training trajectory", "[posthoc][synthesis]") {
  // 2000 steps of SGD with noisy labels; profiles sigma_rel 0.05 and 0.10, snapshots every 100
  // steps (40 files); the EMA with sigma_rel 0.07 tracked directly (the same Ema the post-hoc
  // profiles use) and synthesized afterwards, at the last snapshot and at step 1000.
  TempFolder folder("trajectory");
  torch::manual_seed(5);
  Mlp model;
  const auto direction = torch::randn({16}) / 4.0;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
  emakit::PostHocEma posthoc(*model, emakit::PostHocOptions(folder.path).sigma_rels({0.05, 0.10}).snapshot_every(100));
  emakit::PowerEma direct(*model, emakit::PowerFunction::from_sigma_rel(0.07),
                          emakit::StepSchedule().warmup(emakit::Warmup::skip_before_start));
  std::map<std::int64_t, emakit::StateDict> direct_at;
  for (std::int64_t step = 1; step <= 2000; ++step) {
    const auto x = torch::randn({32, 16});
    const auto y = torch::sin(x.matmul(direction)).unsqueeze(1) + 0.5 * torch::randn({32, 1});
    optimizer.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    optimizer.step();
    posthoc.update();
    direct.update();
    if (step == 1000 || step == 2000) {
      emakit::StateDict copy;
      for (const auto& item : direct.averages()) copy.insert(item.key(), item.value().clone());
      direct_at[step] = std::move(copy);
    }
  }
  for (std::int64_t t : {1000, 2000}) {
    const auto plan = posthoc.plan(emakit::SynthesisOptions::from_sigma_rel(0.07).step(t));
    const auto synthesized = emakit::synthesize(plan);
    const auto& truth = direct_at[t];
    // The scale of the question: how far apart the tracked EMAs of 0.05 and 0.10 are at t.
    const auto narrow = emakit::load_snapshot(folder.path / emakit::snapshot_file_name(t, 0));
    const auto wide = emakit::load_snapshot(folder.path / emakit::snapshot_file_name(t, 1));
    const double error = distance_between(synthesized, truth);
    const double spread = distance_between(narrow, wide);
    const double relative = distance(synthesized, truth);
    WARN(fmt::format("post-hoc reconstruction at t = {} from {} snapshots (condition {:.3g}): |synth - direct| = "
                     "{:.3g} ({:.3g} of |direct|), {:.3g} of |ema(0.05) - ema(0.10)|",
                     t, plan.snapshots.size(), plan.solution.condition, error, relative, error / spread));
    CHECK(relative < 2e-4);
    CHECK(error < 0.02 * spread);
    // Closer than either tracked profile, and than their plain mix.
    CHECK(error < 0.1 * distance_between(narrow, truth));
    CHECK(error < 0.1 * distance_between(wide, truth));
  }
}

TEST_CASE("Synthesis into a module, into a torch.load-able file and into a snapshot file agree",
          "[posthoc][synthesis]") {
  TempFolder folder("outputs");
  torch::manual_seed(6);
  emakit_test::TinyNet model;
  emakit::PostHocEma posthoc(*model,
                             emakit::PostHocOptions(folder.path).snapshot_every(3).snapshot_dtype(torch::kHalf));
  for (int s = 1; s <= 12; ++s) {
    emakit_test::perturb(*model);
    model->bn->num_batches_tracked.fill_(s);
    posthoc.update();
  }
  const auto plan = posthoc.plan(emakit::SynthesisOptions::from_sigma_rel(0.08));
  const auto result = emakit::synthesize(plan);
  CHECK(result["fc.weight"].scalar_type() == torch::kFloat);  // the averages' dtype, not the stored fp16
  CHECK(result["bn.num_batches_tracked"].item<std::int64_t>() == 12);

  emakit_test::TinyNet target;
  emakit::synthesize_into(plan, *target);
  CHECK(torch::equal(target->fc->weight, result["fc.weight"]));
  CHECK(torch::equal(target->bn->running_mean, result["bn.running_mean"]));
  CHECK(target->bn->num_batches_tracked.item<std::int64_t>() == 12);

  const fs::path pickled = folder.path / "synth" / "ema.pt";
  fs::create_directories(pickled.parent_path());
  emakit::synthesize_to_file(plan, pickled);
  const auto bytes = read_bytes(pickled);
  // An untagged dict: Python's torch.load with weights_only=True (its default) refuses the
  // restore_type_tag global that torch::pickle_save writes.
  const std::string_view text(bytes.data(), bytes.size());
  CHECK(text.find("restore_type_tag") == std::string_view::npos);
  CHECK(text.find("_rebuild_tensor_v2") != std::string_view::npos);
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  REQUIRE(dict.size() == result.size());
  for (const auto& item : result) CHECK(torch::equal(dict.at(item.key()).toTensor(), item.value()));

  const fs::path as_snapshot = folder.path / "synth" / "ema.emkit";
  emakit::synthesize_to_file(plan, as_snapshot, emakit::OutputFormat::snapshot);
  const auto info = emakit::read_snapshot_info(as_snapshot);
  CHECK(info.t == 12);
  CHECK(info.sigma_rel == Approx(0.08).margin(1e-12));
  const auto loaded = emakit::load_snapshot(as_snapshot);
  for (const auto& item : result) CHECK(torch::equal(loaded[item.key()], item.value()));

  // As float64, and the fp16 snapshots make it differ from the fp32 tracking by fp16 rounding only.
  const auto wide =
      emakit::synthesize(posthoc.plan(emakit::SynthesisOptions::from_sigma_rel(0.08).dtype(torch::kDouble)));
  CHECK(wide["fc.weight"].scalar_type() == torch::kDouble);
  // The synthesis sums in double either way and the fp32 result is that sum rounded once: bitwise.
  CHECK(torch::equal(wide["fc.weight"].to(torch::kFloat), result["fc.weight"]));
}

namespace {

// Makes a folder unwritable, also for root (which ignores permission bits): the immutable flag.
struct UnwritableFolder {
  fs::path path;
  bool immutable = false;
  explicit UnwritableFolder(const fs::path& p) : path(p) {
    if (::geteuid() != 0) {
      fs::permissions(path, fs::perms::owner_read | fs::perms::owner_exec);
      return;
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
    int flags = 0;
    if (fd >= 0 && ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0) {
      flags |= FS_IMMUTABLE_FL;
      immutable = ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
    }
    if (fd >= 0) ::close(fd);
  }
  ~UnwritableFolder() {
    if (::geteuid() != 0) {
      fs::permissions(path, fs::perms::owner_all);
      return;
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
    int flags = 0;
    if (fd >= 0 && ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0) {
      flags &= ~FS_IMMUTABLE_FL;
      ::ioctl(fd, FS_IOC_SETFLAGS, &flags);
    }
    if (fd >= 0) ::close(fd);
  }
  bool works() const {
    const auto probe = path / "probe";
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) return true;
    ::close(fd);
    ::unlink(probe.c_str());
    return false;
  }
};

}  // namespace

TEST_CASE("A folder without write permission is an error naming it, and no output is left", "[posthoc][errors]") {
  // Whether this machine can make a folder unwritable: not as root without CAP_LINUX_IMMUTABLE or
  // on a file system without the immutable flag. Asked first, with its folders gone before the
  // skip (which ends the process under ctest, running no destructor).
  bool can_lock = false;
  {
    TempFolder probe("readonly-probe");
    UnwritableFolder guard(probe.path);
    can_lock = guard.works();
  }
  if (!can_lock)
    EMAKIT_SKIP("cannot make a folder unwritable here ("
                << (::geteuid() == 0 ? "root without the immutable flag" : "permission bits ignored") << ")");
  TempFolder folder("readonly");
  Scalars model;
  model.set(1);
  emakit::PostHocEma posthoc(model.sources(), emakit::PostHocOptions(folder.path / "run").snapshot_every(1));
  posthoc.update();
  const auto plan = posthoc.plan(emakit::SynthesisOptions::from_sigma_rel(0.07));
  const fs::path locked = folder.path / "locked";
  fs::create_directories(locked);
  UnwritableFolder guard(locked);
  REQUIRE(guard.works());  // as the probe above
  CHECK_THROWS_WITH(emakit::PostHocEma(model.sources(), emakit::PostHocOptions(locked)),
                    Contains(locked.string()) && Contains("not writable"));
  CHECK_THROWS_WITH(emakit::PostHocEma(model.sources(), emakit::PostHocOptions(locked / "sub")),
                    Contains((locked / "sub").string()));
  CHECK_THROWS_WITH(emakit::synthesize_to_file(plan, locked / "ema.pt"), Contains((locked / "ema.pt").string()));
  CHECK_THROWS_WITH(emakit::synthesize_to_file(plan, locked / "ema.emkit", emakit::OutputFormat::snapshot),
                    Contains((locked / "ema.emkit").string()));
  CHECK(fs::is_empty(locked));
}

TEST_CASE("A PostHocEma resumes from its state dict, and a state of other profiles is refused whole",
          "[posthoc][state]") {
  TempFolder folder("resume");
  torch::manual_seed(7);
  emakit_test::TinyNet model;
  const auto options = emakit::PostHocOptions(folder.path).update_every(2).snapshot_every(4);
  emakit::PostHocEma first(*model, options);
  for (int s = 1; s <= 6; ++s) {
    emakit_test::perturb(*model);
    first.update();
  }
  emakit::PostHocEma resumed(*model, options);
  resumed.load_state_dict(first.state_dict());
  CHECK(resumed.step() == 6);
  for (int s = 7; s <= 10; ++s) {
    emakit_test::perturb(*model);
    first.update();
    resumed.update();
  }
  for (std::size_t i = 0; i < 2; ++i)
    for (const auto& item : first.ema(i).averages())
      CHECK(emakit_test::bitwise_equal(resumed.ema(i).average(item.key()), item.value()));

  emakit::PostHocEma other(
      *model, emakit::PostHocOptions(folder.path).sigma_rels({0.05, 0.12}).update_every(2).snapshot_every(4));
  const auto before = other.ema(0).average("fc.weight").clone();
  CHECK_THROWS_WITH(other.load_state_dict(first.state_dict()),
                    Contains("profile 1") && Contains("config.decay.gamma") && Contains("differs"));
  CHECK(emakit_test::bitwise_equal(other.ema(0).average("fc.weight"), before));  // profile 0 untouched
  CHECK(other.step() == 0);
}

namespace {
// A PostHocEma's whole state, as plain tensors (to compare before and after).
std::map<std::string, torch::Tensor> state_of(const emakit::PostHocEma& p) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : p.state_dict()) out.emplace(item.key(), item.value().clone());
  return out;
}
bool same_state(const emakit::PostHocEma& p, const std::map<std::string, torch::Tensor>& want) {
  const auto got = p.state_dict();
  if (got.size() != want.size()) return false;
  for (const auto& item : got)
    if (!want.count(item.key()) || !emakit::detail::bitwise_equal(item.value(), want.at(item.key())))
      return false;  // the same bytes (an EMA never updated holds a NaN last decay)
  return true;
}
}  // namespace

TEST_CASE("emakit::save and emakit::load keep a PostHocEma in a checked file: a round trip resumes bitwise, a "
          "damaged or foreign file is refused and changes nothing",
          "[posthoc][state][untrusted]") {
  TempFolder folder("posthoc-file"), files("posthoc-file-saved");
  torch::manual_seed(8);
  emakit_test::TinyNet model;
  const auto options = emakit::PostHocOptions(folder.path).update_every(2).snapshot_every(4);
  emakit::PostHocEma first(*model, options);
  for (int s = 1; s <= 6; ++s) {
    emakit_test::perturb(*model);
    first.update();
  }
  const fs::path good = files.path / "posthoc.pt";
  emakit::save(first, good);
  emakit::PostHocEma resumed(*model, options);
  emakit::load(resumed, good);
  CHECK(same_state(resumed, state_of(first)));
  CHECK(resumed.run() == first.run());
  for (int s = 7; s <= 12; ++s) {
    emakit_test::perturb(*model);
    first.update();
    resumed.update();
  }
  CHECK(same_state(resumed, state_of(first)));
  std::size_t compared = 0;
  for (std::size_t i = 0; i < first.size(); ++i)
    for (const auto& item : first.ema(i).averages()) {
      CHECK(emakit_test::bitwise_equal(resumed.ema(i).average(item.key()), item.value()));
      ++compared;
    }
  CHECK(compared == 2 * first.ema(0).averages().size());

  // A second save over the first is atomic (write_archive): the file is whole before and after.
  emakit::save(first, good);
  emakit::PostHocEma reread(*model, options);
  emakit::load(reread, good);
  CHECK(same_state(reread, state_of(first)));

  // Damaged copies: each is refused naming the file and changes nothing, or loads exactly what was saved.
  int refused = 0, tried = 0;
  for (const auto& [file, at] : emakit_test::flipped_copies(good, files.path)) {
    INFO("byte " << at);
    ++tried;
    emakit::PostHocEma target(*model, options);
    const auto untouched = state_of(target);
    try {
      emakit::load(target, file);
      CHECK(same_state(target, state_of(first)));  // loaded: exactly what was saved
    } catch (const std::exception& e) {
      ++refused;
      CHECK_THAT(e.what(), Contains(file.filename().string()));
      CHECK(same_state(target, untouched));
    }
  }
  CHECK(tried >= 20);
  CHECK(refused >= tried / 4);
  // Truncated.
  {
    auto bytes = read_bytes(good);
    bytes.resize(bytes.size() / 2);
    write_bytes(files.path / "truncated.pt", bytes);
    emakit::PostHocEma fresh(*model, options);
    const auto before = state_of(fresh);
    CHECK_THROWS_WITH(emakit::load(fresh, files.path / "truncated.pt"), Contains("truncated.pt"));
    CHECK(same_state(fresh, before));
  }
  // An Ema's file is not a PostHocEma's, and the other way round; other profiles are refused whole.
  emakit::FixedEma ema(*model);
  emakit::save(ema, files.path / "ema.pt");
  emakit::PostHocEma fresh(*model, options);
  const auto before = state_of(fresh);
  CHECK_THROWS_WITH(emakit::load(fresh, files.path / "ema.pt"),
                    Contains("ema.pt") && Contains("not a PostHocEma's state_dict() (it is an Ema's)"));
  CHECK(same_state(fresh, before));
  const auto ema_before = emakit_test::snapshot(ema.averages());
  CHECK_THROWS_WITH(emakit::load(ema, good), Contains("posthoc.pt"));
  CHECK(emakit_test::same_averages(ema.averages(), ema_before));
  emakit::PostHocEma other(
      *model, emakit::PostHocOptions(folder.path).sigma_rels({0.05, 0.12}).update_every(2).snapshot_every(4));
  const auto other_before = state_of(other);
  CHECK_THROWS_WITH(emakit::load(other, good),
                    Contains("posthoc.pt") && Contains("profile 1") && Contains("config.decay.gamma"));
  CHECK(same_state(other, other_before));
}

// ---- a real kill in mid-write ---------------------------------------------------------------

// The child of the kill test (hidden: runs only when named, with EMAKIT_POSTHOC_WRITER_DIR set).
// Writes 2 x 16 MB snapshots at three more steps, then rewrites the last ones until it is killed.
// Every writer is the same run, as a trainer restarted from its checkpoint would be: it saves its
// state (atomically) after each update, and the next writer resumes from the last one saved (a
// kill between an update and its save leaves that step's snapshots to the next writer, which
// sets them aside: another history of the run).
TEST_CASE("posthoc kill-test writer", "[.posthoc-writer]") {
  const char* dir = std::getenv("EMAKIT_POSTHOC_WRITER_DIR");
  if (dir == nullptr) return;
  std::vector<emakit::SourceTensor> sources = {{"a", torch::zeros({2 << 20})}, {"b", torch::zeros({2 << 20})}};
  emakit::PostHocEma posthoc(sources, emakit::PostHocOptions(dir).snapshot_every(1));
  const fs::path state = fs::path(dir) / "writer-state.pt";
  if (fs::exists(state)) {
    emakit::load(posthoc, state);
  } else {
    emakit::save(posthoc, state);
  }
  for (int step = 1; step <= 3; ++step) {
    for (auto& s : sources) s.tensor.uniform_();
    posthoc.update();
    emakit::save(posthoc, state);
  }
  // Until killed; a guard against an orphan that nobody kills (it also dies with its parent).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  while (std::chrono::steady_clock::now() < give_up) posthoc.snapshot();
}

TEST_CASE("A snapshot folder survives a writer killed (SIGKILL) in mid-write", "[posthoc][snapshot][kill]") {
  TempFolder folder("kill");
  const std::vector<std::string> writer_args = {emakit_subprocess::own_executable(), "posthoc kill-test writer"};
  const emakit_subprocess::Options writer_options{
      .env = {"EMAKIT_POSTHOC_WRITER_DIR=" + folder.path.string(), "OMP_NUM_THREADS=1"},
      .die_with_parent = true};  // the writer dies with this test

  std::mt19937 random(12345);
  auto count_temporary = [&](std::string_view prefix) {  // temporary files whose name starts with prefix
    std::size_t k = 0;
    for (const auto& e : fs::directory_iterator(folder.path)) {
      const auto name = e.path().filename().string();
      k += emakit::detail::is_temporary_name(name) && name.rfind(prefix, 0) == 0 ? 1 : 0;
    }
    return k;
  };
  std::size_t killed_with_temporary = 0, left_total = 0;
  const int rounds = 6;
  for (int round = 0; round < rounds; ++round) {
    emakit_subprocess::Process child(writer_args, writer_options);
    // Wait until the writer is writing a snapshot (its temporary file exists), then kill it at once (odd
    // rounds) or at a random moment within the next 300 ms (even rounds).
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    auto alive = [&] { return child.running(); };
    // The first round also waits for the writer's first two steps of snapshots (the checks below
    // want two whole files: those of step 1, which the state saved before step 2 keeps for every
    // later writer; a slow machine, or one under a sanitizer, may take most of a second).
    while (round == 0 && emakit::list_snapshots(folder.path).size() < 4 && alive() &&
           std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    while (count_temporary(".phema-") == 0 && alive() && std::chrono::steady_clock::now() < give_up)
      std::this_thread::yield();
    if (round % 2 == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 300)(random)));
    const bool was_alive = child.signal(SIGKILL);
    const int status = child.wait();
    INFO("round " << round);
    REQUIRE(was_alive);
    REQUIRE(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGKILL);

    // Every file under a snapshot name loads whole; temporary files are never taken for one.
    const auto listed = emakit::list_snapshots(folder.path);
    CHECK(listed.size() >= 2);
    for (const auto& info : listed) {
      CHECK_NOTHROW(emakit::load_snapshot(info.path));
      CHECK_FALSE(emakit::detail::is_temporary_name(info.path.filename().string()));
    }
    const auto leftovers = emakit::interrupted_writes(folder.path);
    CHECK(leftovers.size() == count_temporary("."));
    if (round % 2 == 1 && !leftovers.empty()) ++killed_with_temporary;
    left_total += leftovers.size();
    for (const auto& p : leftovers) fs::remove(p);
  }
  // The odd rounds killed the writer while its temporary file existed, i.e. in mid-write.
  CHECK(killed_with_temporary >= 1);
  WARN(fmt::format("{} kills; {} of the {} immediate ones left a temporary file; {} temporary files in all", rounds,
                   killed_with_temporary, rounds / 2, left_total));
  // A kill between the profiles of one step leaves that step's set incomplete (the next writer,
  // resumed from the state of the step before, sets it aside; the last kill's stays): the
  // completeness check refuses such a folder unless allowed, and each kill leaves at most one
  // profile of one step missing.
  auto options = emakit::SynthesisOptions::from_sigma_rel(0.07);
  const auto missing = emakit::detail::missing_snapshots(emakit::list_snapshots(folder.path));
  if (!missing.empty()) CHECK_THROWS_AS(emakit::plan_synthesis(folder.path, options), emakit::SynthesisRefused);
  const auto plan = emakit::plan_synthesis(folder.path, options.allow_partial(true));
  CHECK(plan.missing.size() == missing.size());
  CHECK(plan.missing.size() <= static_cast<std::size_t>(rounds));
  CHECK(plan.snapshots.front().t >= 1);
  CHECK_NOTHROW(emakit::synthesize(plan));
}

// ---- one run per folder, complete snapshot sets, targets the snapshots can reproduce -----------

namespace {

// Every file of a folder (not recursing) -> its bytes.
std::map<std::string, std::vector<char>> folder_bytes(const fs::path& folder) {
  std::map<std::string, std::vector<char>> out;
  for (const auto& e : fs::directory_iterator(folder))
    if (e.is_regular_file()) out[e.path().filename().string()] = read_bytes(e.path());
  return out;
}

emakit::StateDict read_state(const fs::path& file) {
  emakit::StateDict out;
  for (const auto& item : emakit::detail::read_pickle_dict(file, "a test state"))
    out.insert(item.key().toStringRef(), item.value().toTensor());
  return out;
}

// The model of tests/fixtures/posthoc_v1 (its generate.cpp).
torch::nn::Sequential fixture_model() {
  return torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
}

fs::path fixture_v1() { return emakit_test::repo_file("tests/fixtures/posthoc_v1/state.pt").parent_path(); }

// A copy of the format-1 fixture's snapshot files in `folder`.
void copy_fixture_snapshots(const fs::path& folder) {
  for (const auto& e : fs::directory_iterator(fixture_v1()))
    if (emakit::is_snapshot_file_name(e.path().filename().string()))
      fs::copy_file(e.path(), folder / e.path().filename());
}

}  // namespace

TEST_CASE("Each snapshot records its run, its profiles and the run's previous snapshot step", "[posthoc][runs]") {
  TempFolder folder("run-header");
  torch::manual_seed(11);
  emakit_test::TinyNet model;
  emakit::PostHocEma posthoc(*model,
                             emakit::PostHocOptions(folder.path).snapshot_every(2).sigma_rels({0.05, 0.08, 0.12}));
  REQUIRE(posthoc.run().recorded());
  CHECK(posthoc.run().hex().size() == 32);
  CHECK(posthoc.run_started() > 1700000000);  // Unix seconds, after 2023
  for (int s = 1; s <= 6; ++s) {
    emakit_test::perturb(*model);
    posthoc.update();
  }
  posthoc.snapshot();  // a second snapshot at step 6 rewrites those files, in the same place in the chain
  const auto listed = emakit::list_snapshots(folder.path);
  REQUIRE(listed.size() == 9);
  const std::map<std::int64_t, std::int64_t> previous = {{2, 0}, {4, 2}, {6, 4}};
  for (const auto& s : listed) {
    INFO(s.path.string());
    CHECK(s.format_version == 2);
    CHECK(s.run == posthoc.run());
    CHECK(s.run_started == posthoc.run_started());
    CHECK(s.profiles == 3);
    CHECK(s.previous_step == previous.at(s.step));
    CHECK(s.fingerprint == emakit::model_fingerprint(s.tensors));
    CHECK(s.fingerprint == listed.front().fingerprint);
  }
  // The fingerprint is of the model: another shape of one tensor changes it.
  auto other = listed.front().tensors;
  other.front().sizes.back() += 1;
  CHECK(emakit::model_fingerprint(other) != listed.front().fingerprint);
  // Two PostHocEmas are two runs.
  CHECK(emakit::PostHocEma(*model, emakit::PostHocOptions(folder.path)).run() != posthoc.run());
  // A header whose stored fingerprint disagrees with its table is corrupt.
  auto bytes = read_bytes(listed.front().path);
  const std::size_t fingerprint_at = 16 + 8 * 5 + 4 * 2 + 8 + 16 + 8 * 2;  // see snapshot_file.hpp
  std::uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + fingerprint_at, 8);
  REQUIRE(stored == listed.front().fingerprint);
  bytes[fingerprint_at] ^= 0x01;
  std::uint32_t header_size = 0;
  std::memcpy(&header_size, bytes.data() + 12, 4);
  const std::uint32_t crc = emakit::detail::crc32(bytes.data(), 16 + header_size);  // a valid header CRC again
  std::memcpy(bytes.data() + 16 + header_size, &crc, 4);
  const fs::path bad = folder.path / "phema-0000000099-0.emkit";
  write_bytes(bad, bytes);
  CHECK_THROWS_WITH(emakit::read_snapshot_info(bad), Contains(bad.string()) && Contains("model fingerprint"));
}

TEST_CASE("Another run's snapshots in the folder are refused at the first update, before anything changes",
          "[posthoc][runs][errors]") {
  TempFolder folder("two-runs");
  torch::manual_seed(12);
  emakit_test::TinyNet model;
  const auto options = emakit::PostHocOptions(folder.path).snapshot_every(2);
  emakit::PostHocEma first(*model, options);
  for (int s = 1; s <= 4; ++s) {
    emakit_test::perturb(*model);
    first.update();
  }
  const auto before = folder_bytes(folder.path);
  REQUIRE(before.size() == 4);

  // Another run, another model, the same folder (a sample re-run with its folder hard-coded).
  torch::nn::Linear other_model(5, 2);
  emakit::PostHocEma second(*other_model, options);
  const auto weight_before = second.ema(0).average("weight").clone();
  CHECK_THROWS_WITH(second.update(), Contains(folder.path.string()) && Contains("another training run") &&
                                         Contains("run " + first.run().short_hex()) &&
                                         Contains("4 snapshots, t = 2 to 4") &&
                                         Contains("This PostHocEma is run " + second.run().short_hex()) &&
                                         Contains("load_state_dict") && Contains("ExistingSnapshots::move_aside"));
  CHECK(second.step() == 0);
  CHECK(emakit_test::bitwise_equal(second.ema(0).average("weight"), weight_before));
  CHECK(folder_bytes(folder.path) == before);

  // The run resumed from its state writes on, in the chain after its last snapshot.
  emakit::PostHocEma resumed(*model, options);
  resumed.load_state_dict(first.state_dict());
  CHECK(resumed.run() == first.run());
  CHECK(resumed.run_started() == first.run_started());
  for (int s = 5; s <= 6; ++s) {
    emakit_test::perturb(*model);
    resumed.update();
  }
  const auto info = emakit::read_snapshot_info(folder.path / "phema-0000000006-0.emkit");
  CHECK(info.run == first.run());
  CHECK(info.previous_step == 4);
  CHECK(emakit::plan_synthesis(folder.path, emakit::SynthesisOptions::from_sigma_rel(0.07)).snapshots.size() == 6);

  // A folder that holds two runs anyway (files copied in) is refused by the synthesis, naming both.
  TempFolder elsewhere("two-runs-other");
  emakit::PostHocEma third(*model, emakit::PostHocOptions(elsewhere.path).snapshot_every(8));
  for (int s = 1; s <= 8; ++s) third.update();
  fs::copy_file(elsewhere.path / "phema-0000000008-0.emkit", folder.path / "phema-0000000008-0.emkit");
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, emakit::SynthesisOptions::from_sigma_rel(0.07)),
                    Contains("2 training runs") && Contains("run " + first.run().short_hex() + " (started ") &&
                        Contains("6 snapshots, t = 2 to 6") && Contains("run " + third.run().short_hex()) &&
                        Contains("1 snapshot, t = 8 to 8"));
}

// A run resumed from an older checkpoint than its last snapshot: the snapshots written after that
// checkpoint by the run that crashed are another history of the same run (same id, correct
// previous-step links). They are set aside at the resumed run's first update, so that the folder
// is, and synthesizes, exactly as if that branch had never run (against a run that never had it).
TEST_CASE("A run resumed from an older checkpoint sets aside its abandoned branch's snapshots and synthesizes as "
          "if it had never run",
          "[posthoc][runs]") {
  TempFolder folder("resume-branch"), reference_folder("resume-branch-reference");
  torch::manual_seed(21);
  emakit_test::TinyNet model;
  const auto options = emakit::PostHocOptions(folder.path).snapshot_every(10);
  const auto train = [&](emakit::PostHocEma& ema, int from, int to, std::uint64_t seed, double lr) {
    torch::manual_seed(seed);
    for (int s = from; s <= to; ++s) {
      emakit_test::perturb(*model, lr);
      ema.update();
    }
  };
  const auto restore = [&](const std::map<std::string, torch::Tensor>& weights) {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) p.value().copy_(weights.at(p.key()));
    for (auto& b : model->named_buffers()) b.value().copy_(weights.at(b.key()));
  };
  emakit::StateDict checkpoint;  // the state at step 30, and the model's weights then
  std::map<std::string, torch::Tensor> weights;
  std::map<std::string, std::vector<char>> dead_files;
  emakit::RunId run;
  {
    emakit::PostHocEma first(*model, options);
    train(first, 1, 30, 1, 0.1);
    checkpoint = first.state_dict();
    weights = emakit_test::model_snapshot(*model);
    for (const auto& f : fs::directory_iterator(folder.path))  // the reference run's history up to step 30
      fs::copy_file(f.path(), reference_folder.path / f.path().filename());
    train(first, 31, 55, 2, 0.1);  // snapshots at 40 and 50, then the process dies at 55
    run = first.run();
    for (const auto& [name, bytes] : folder_bytes(folder.path))
      if (emakit::is_snapshot_file_name(name) && std::stoll(name.substr(6, 10)) > 30) dead_files[name] = bytes;
  }
  REQUIRE(dead_files.size() == 2 * 2);  // steps 40 and 50, two profiles

  // Resumed from step 30 with another learning rate, stopped at 45.
  restore(weights);
  emakit::PostHocEma resumed(*model, options);
  resumed.load_state_dict(checkpoint);
  emakit_test::WarningCapture warnings;
  train(resumed, 31, 45, 3, 0.05);
  const std::string aside_name = fmt::format("abandoned-{}-after-30", run.short_hex());
  REQUIRE(warnings.messages.size() == 1);  // said once, at the first update
  CHECK_THAT(warnings.messages[0], Contains("run " + run.short_hex() + " goes on from step 30") &&
                                       Contains("4 of its snapshots from after that step (t = 40 to 50)") &&
                                       Contains((folder.path / aside_name).string()));
  CHECK(folder_bytes(folder.path / aside_name) == dead_files);  // moved whole, not rewritten

  // The same history without the crashed branch, in a folder of its own.
  restore(weights);
  emakit::PostHocEma reference(*model, emakit::PostHocOptions(reference_folder.path).snapshot_every(10));
  reference.load_state_dict(checkpoint);
  train(reference, 31, 45, 3, 0.05);

  const auto listed = emakit::list_snapshots(folder.path), expected = emakit::list_snapshots(reference_folder.path);
  REQUIRE(listed.size() == 4 * 2);
  REQUIRE(listed.size() == expected.size());
  for (std::size_t i = 0; i < listed.size(); ++i) {
    CHECK(listed[i].path.filename() == expected[i].path.filename());
    CHECK(read_bytes(listed[i].path) == read_bytes(expected[i].path));
  }
  for (const double sigma_rel : {0.07, 0.12}) {
    const auto plan = resumed.plan(emakit::SynthesisOptions::from_sigma_rel(sigma_rel));
    CHECK(plan.target.t == 40);
    const auto got = emakit::synthesize(plan);
    const auto want = reference.synthesize(emakit::SynthesisOptions::from_sigma_rel(sigma_rel));
    REQUIRE(got.size() == want.size());
    for (const auto& item : want) CHECK(emakit_test::bitwise_equal(got[item.key()], item.value()));
  }
  // A later resume from the same checkpoint sets the newer branch aside beside the first.
  restore(weights);
  emakit::PostHocEma again(*model, options);
  again.load_state_dict(checkpoint);
  again.update();
  CHECK(folder_bytes(folder.path / (aside_name + "-2")).size() == 1 * 2);  // step 40 of the second branch
}

TEST_CASE("ExistingSnapshots::move_aside moves another run's snapshots into previous-run-<id>, whole",
          "[posthoc][runs]") {
  TempFolder folder("move-aside");
  copy_fixture_snapshots(folder.path);  // format 1: no run id
  const auto legacy = folder_bytes(folder.path);
  REQUIRE(legacy.size() == 12);
  torch::manual_seed(13);
  emakit_test::TinyNet model;
  const auto options =
      emakit::PostHocOptions(folder.path).snapshot_every(2).existing_snapshots(emakit::ExistingSnapshots::move_aside);
  emakit::PostHocEma first(*model, options);
  for (int s = 1; s <= 2; ++s) first.update();
  CHECK(folder_bytes(folder.path / "previous-run-none") == legacy);
  const auto mine = emakit::list_snapshots(folder.path);
  REQUIRE(mine.size() == 2);
  for (const auto& s : mine) CHECK(s.run == first.run());
  const auto first_files = folder_bytes(folder.path);

  emakit::PostHocEma second(*model, options);
  second.update();
  second.update();
  const fs::path aside = folder.path / ("previous-run-" + first.run().short_hex());
  auto moved = folder_bytes(aside);
  CHECK(moved.size() == 2);
  for (const auto& [name, bytes] : moved) CHECK(first_files.at(name) == bytes);
  CHECK(folder_bytes(folder.path / "previous-run-none") == legacy);  // an earlier move is left alone
  CHECK(emakit::list_snapshots(folder.path).size() == 2);
  CHECK(emakit::plan_synthesis(folder.path, emakit::SynthesisOptions::from_sigma_rel(0.07)).run == second.run());
}

TEST_CASE("Format 1 snapshots and states still read: the fixture synthesizes as it did, and its run goes on",
          "[posthoc][runs][format]") {
  const auto listed = emakit::list_snapshots(fixture_v1());
  REQUIRE(listed.size() == 12);
  for (const auto& s : listed) {
    CHECK(s.format_version == 1);
    CHECK_FALSE(s.run.recorded());
    CHECK(s.previous_step == -1);
    CHECK(s.profiles == 0);
  }
  // The results format 1's emakit wrote (generate.cpp) are reproduced bitwise.
  for (const auto& [file, step] :
       std::vector<std::pair<std::string, std::int64_t>>{{"synth-0.07.pt", 30}, {"synth-0.07-t20.pt", 20}}) {
    INFO(file);
    const auto plan = emakit::plan_synthesis(fixture_v1(), emakit::SynthesisOptions::from_sigma_rel(0.07).step(step));
    CHECK(plan.snapshots.size() == static_cast<std::size_t>(step / 5 * 2));
    const auto result = emakit::synthesize(plan);
    const auto recorded = read_state(fixture_v1() / file);
    REQUIRE(result.size() == recorded.size());
    std::size_t compared = 0;
    for (const auto& item : recorded) compared += emakit_test::bitwise_equal(result[item.key()], item.value()) ? 1 : 0;
    CHECK(compared == 7);  // 0.weight, 0.bias, 1.weight, 1.bias, 1.running_mean, 1.running_var, 1.num_batches_tracked
  }

  // The format-1 state resumes the run without an id, and its new snapshots (format 2) join the old ones.
  TempFolder folder("v1-resume");
  copy_fixture_snapshots(folder.path);
  auto model = fixture_model();
  const auto options = emakit::PostHocOptions(folder.path).snapshot_every(5);
  emakit::PostHocEma fresh(*model, options);
  CHECK_THROWS_WITH(fresh.update(), Contains("snapshots without a run id: 12 snapshots, t = 5 to 30"));
  emakit::PostHocEma posthoc(*model, options);
  const auto state = read_state(fixture_v1() / "state.pt");
  REQUIRE(emakit::detail::StateReader(state).counter("posthoc.format") == 1);
  posthoc.load_state_dict(state);
  CHECK(posthoc.step() == 30);
  CHECK_FALSE(posthoc.run().recorded());
  for (int s = 31; s <= 35; ++s) posthoc.update();
  const auto info = emakit::read_snapshot_info(folder.path / "phema-0000000035-1.emkit");
  CHECK(info.format_version == 2);
  CHECK_FALSE(info.run.recorded());
  CHECK(info.previous_step == 30);
  CHECK(info.profiles == 2);
  const auto plan = emakit::plan_synthesis(folder.path, emakit::SynthesisOptions::from_sigma_rel(0.07));
  CHECK(plan.snapshots.size() == 14);
  CHECK(plan.missing.empty());
}

TEST_CASE("A snapshot set with gaps is refused naming each missing file, and allow_partial lists them",
          "[posthoc][synthesis][errors]") {
  TempFolder folder("gaps");
  torch::manual_seed(14);
  emakit_test::TinyNet model;
  emakit::PostHocEma posthoc(*model, emakit::PostHocOptions(folder.path).snapshot_every(2));
  for (int s = 1; s <= 12; ++s) {
    emakit_test::perturb(*model);
    posthoc.update();
  }
  const auto options = emakit::SynthesisOptions::from_sigma_rel(0.07);
  const auto full = emakit::synthesize(emakit::plan_synthesis(folder.path, options));
  const fs::path keep = folder.path / "kept";
  fs::create_directories(keep);
  auto remove = [&](std::initializer_list<const char*> names) {
    for (const char* n : names) fs::rename(folder.path / n, keep / n);
  };
  auto restore = [&] {
    for (const auto& e : fs::directory_iterator(keep)) fs::rename(e.path(), folder.path / e.path().filename());
  };

  // One profile at the target time (the case: 1.2% away, said nothing).
  remove({"phema-0000000012-1.emkit"});
  CHECK_THROWS_AS(emakit::plan_synthesis(folder.path, options), emakit::SynthesisRefused);
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, options),
                    Contains("1 snapshot of the run is missing") &&
                        Contains("profile 1 (sigma_rel 0.1000) at step 12 ('phema-0000000012-1.emkit')") &&
                        Contains("allow_partial") && Contains("--allow-partial"));
  auto partial_options = options;
  partial_options.allow_partial(true);
  const auto partial = emakit::plan_synthesis(folder.path, partial_options);
  REQUIRE(partial.missing.size() == 1);
  CHECK(partial.missing[0].step == 12);
  CHECK(partial.missing[0].profile == 1);
  CHECK(partial.missing[0].file_name == "phema-0000000012-1.emkit");
  CHECK(partial.snapshots.size() == 11);
  CHECK(distance(emakit::synthesize(partial), full) > 1e-6);  // what the refusal protects against
  // An earlier target does not need it.
  CHECK(emakit::plan_synthesis(folder.path, emakit::SynthesisOptions::from_sigma_rel(0.07).step(10)).missing.empty());
  restore();

  // A whole time in the middle: the step-8 files name step 6 as the one before them.
  remove({"phema-0000000006-0.emkit", "phema-0000000006-1.emkit"});
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, options), Contains("2 snapshots of the run are missing") &&
                                                                      Contains("'phema-0000000006-0.emkit'") &&
                                                                      Contains("'phema-0000000006-1.emkit'"));
  restore();
  // The first time: the step-4 files name step 2.
  remove({"phema-0000000002-0.emkit", "phema-0000000002-1.emkit"});
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, options), Contains("'phema-0000000002-1.emkit'"));
  restore();
  // Every file of one profile: the files record that the run tracks two.
  remove({"phema-0000000002-1.emkit", "phema-0000000004-1.emkit", "phema-0000000006-1.emkit",
          "phema-0000000008-1.emkit", "phema-0000000010-1.emkit", "phema-0000000012-1.emkit"});
  CHECK_THROWS_WITH(
      emakit::plan_synthesis(folder.path, options),
      Contains("6 snapshots of the run are missing") && Contains("profile 1 (no file of it is left) at step 2"));
  restore();
  CHECK(distance(emakit::synthesize(emakit::plan_synthesis(folder.path, options)), full) == 0.0);
}

TEST_CASE("A target the snapshots cannot reproduce is refused, and the plan reports its weights and error",
          "[posthoc][synthesis][errors]") {
  // The fixture: sigma_rel 0.05 and 0.10 at t = 5, ..., 30 (the case: sigma_rel 0.001 gave
  // weights of +-8 with a raw sum of 0.757, and no warning).
  const auto folder = fixture_v1();
  CHECK_THROWS_AS(emakit::plan_synthesis(folder, emakit::SynthesisOptions::from_sigma_rel(0.001)),
                  emakit::SynthesisRefused);
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder, emakit::SynthesisOptions::from_sigma_rel(0.001)),
                    Contains("sigma_rel 0.001 lies 50x outside the tracked profiles' range 0.05 to 0.1") &&
                        Contains("max_extrapolation") && Contains("--max-extrapolation"));
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder, emakit::SynthesisOptions::from_sigma_rel(0.26)),
                    Contains("2.6x outside"));
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder, emakit::SynthesisOptions::from_sigma_rel(0.019)),
                    Contains("2.63x outside"));
  CHECK_NOTHROW(
      emakit::plan_synthesis(folder, emakit::SynthesisOptions::from_sigma_rel(0.25)));  // 2.5x: the bound itself
  // Past max_extrapolation, the fit error refuses it too (0.87 over the updates, above 0.5).
  const auto unbounded =
      emakit::SynthesisOptions::from_sigma_rel(0.001).max_extrapolation(std::numeric_limits<double>::infinity());
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder, unbounded),
                    Contains("cannot represent sigma_rel 0.001") && Contains("above max_fit_error 0.5"));
  const auto far = emakit::plan_synthesis(
      folder, emakit::SynthesisOptions(unbounded).max_fit_error(std::numeric_limits<double>::infinity()));
  CHECK(far.solution.fit_error > 0.5);
  double largest = 0, sum = 0;
  for (double w : far.solution.weights) {
    largest = std::max(largest, std::abs(w));
    sum += std::abs(w);
  }
  CHECK(far.solution.max_abs_weight == largest);
  CHECK(far.solution.abs_sum == sum);
  CHECK(largest > 5);
  CHECK(far.solution.profile_error > 0.5);  // the combined profile is far from the one asked for

  // Weights past max_weight, for a target inside the range.
  auto inside = emakit::SynthesisOptions::from_sigma_rel(0.07);
  const auto plan = emakit::plan_synthesis(folder, inside);
  CHECK(plan.tracked_min_sigma_rel == Approx(0.05).epsilon(1e-12));
  CHECK(plan.tracked_max_sigma_rel == Approx(0.10).epsilon(1e-12));
  CHECK(plan.solution.max_abs_weight < 1.0);
  CHECK_THROWS_WITH(
      emakit::plan_synthesis(folder, inside.max_weight(plan.solution.max_abs_weight / 2)),
      Contains("reach") && Contains("max_weight") && Contains("phema-00000000") && Contains("--max-weight"));

  // profile_error is the L2 distance of the profiles, checked by integrating them numerically:
  // the midpoint rule on each interval between snapshot times (where the profiles end), 2^16
  // cells each; its error is O(h^2), below 1e-9 of the result here.
  const auto checked = emakit::plan_synthesis(folder, emakit::SynthesisOptions::from_sigma_rel(0.03));
  auto profile = [](double t, double gamma, double tau) {
    return tau > t ? 0.0 : (gamma + 1.0) * std::pow(tau / t, gamma) / t;
  };
  const int cells = 1 << 16;
  double diff = 0, own = 0;
  for (double start = 0; start < checked.target.t; start += 5) {  // the fixture's snapshots are 5 steps apart
    const double h = 5.0 / cells;
    for (int k = 0; k < cells; ++k) {
      const double tau = start + (k + 0.5) * h;
      double combined = 0;
      for (std::size_t i = 0; i < checked.snapshots.size(); ++i)
        combined += checked.solution.weights[i] *
                    profile(static_cast<double>(checked.snapshots[i].t), checked.snapshots[i].gamma, tau);
      const double q = profile(checked.target.t, checked.target.gamma, tau);
      diff += (combined - q) * (combined - q) * h;
      own += q * q * h;
    }
  }
  CHECK(checked.solution.profile_error == Approx(std::sqrt(diff / own)).epsilon(1e-9));
  CHECK(checked.solution.profile_error > 0.01);

  // Every target of docs/posthoc.md's sample and the demo's sweep (0.02 to 0.20 from 0.05 and 0.10)
  // passes the defaults.
  for (double s : {0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.10, 0.12, 0.13, 0.16, 0.20})
    CHECK_NOTHROW(emakit::plan_synthesis(folder, emakit::SynthesisOptions::from_sigma_rel(s)));
}

}  // namespace test_posthoc
