// Moving a run between Python and C++ with the real packages: a state a Python peer saved is
// imported and the run continues in C++ with the peer's numbers; an emakit export is read by
// Python's torch.load (weights_only) and loaded by the peer itself (tests/conformance/_check_export.py).
// The first step after the import starts from the imported state (replay.hpp), so it also shows
// that the import carried the peer's numbers; tolerances as test_peers.cpp (kLerp, derived there).
#include <emakit/interop.hpp>

#include "../../examples/subprocess.hpp"
#include "replay.hpp"

#include <unistd.h>

using namespace emakit_conformance;

namespace {

constexpr double kLerp = 1.5;  // ulps per update: ATen's lerp against emakit's (test_peers.cpp)

// The replay from `first` compared each tensor the peer recorded, every model tensor at every step.
void require_counts(const Replay& r, const fs::path& dir, std::int64_t first) {
  REQUIRE(r.compared == expected_comparisons(dir, first));
  REQUIRE(r.compared == model_tensors(dir) * r.steps);
}

// Runs tests/conformance/_check_export.py with the venv's Python; returns its exit status.
int check_in_python(const std::string& exported, const fs::path& reference, const char* peer) {
  const std::string python = EMAKIT_CONFORMANCE_PYTHON;
  REQUIRE(!python.empty());
  return emakit_subprocess::run({python, fmt::format("{}/_check_export.py", EMAKIT_CONFORMANCE_SCRIPTS), exported,
                                 reference.string(), peer});
}

std::string temp_path(const char* name) {
  return (fs::temp_directory_path() / fmt::format("emakit_{}_{}.pt", name, ::getpid())).string();
}

// The averages `ema` holds, as a plain dict of peer.<name> (the reference _check_export.py wants
// the export to equal bitwise).
template <class E>
fs::path save_averages(const E& ema, const char* name) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : ema.averages()) d.insert("peer." + item.key(), item.value());
  const fs::path file = temp_path(name);
  const auto bytes = torch::pickle_save(c10::IValue(d));
  std::ofstream(file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return file;
}

}  // namespace

TEST_CASE("ema-pytorch: a run saved in Python continues in C++ with the same numbers and counters",
          "[conformance][interop][ema-pytorch]") {
  const auto dir = scenario_dir("ema_pytorch_peer", "defaults_with_skips");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::ema_pytorch(sources);
  const auto report = emakit::import_state(ema, emakit::Peer::ema_pytorch, step_file(*dir, "state", 120).string());
  CHECK(report.clean());
  CHECK(ema.step() == load_dict(step_file(*dir, "step", 120)).at("counter.step").item<std::int64_t>());
  require_counts(replay(*dir, sources, ema, false, ema_pytorch_counters, kLerp, false, /*first_step=*/121), *dir, 121);

  const auto path = temp_path("ema_pytorch_export");
  emakit::export_state(ema, emakit::Peer::ema_pytorch, path);
  const fs::path held = save_averages(ema, "ema_pytorch_held");
  CHECK(check_in_python(path, held, "ema_pytorch") == 0);
  fs::remove(path);
  fs::remove(held);
}

TEST_CASE("AveragedModel: a run saved in Python continues in C++, the export loads in Python",
          "[conformance][interop][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "ema_no_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::averaged_model_ema(sources, {.decay = 0.95, .use_buffers = false});
  CHECK(emakit::import_state(ema, emakit::Peer::averaged_model, step_file(*dir, "state", 12).string()).clean());
  CHECK(ema.num_updates() == load_dict(step_file(*dir, "step", 12)).at("counter.n_averaged").item<std::int64_t>());
  require_counts(replay(*dir, sources, ema, false, averaged_model_counters, kLerp, false, 13), *dir, 13);

  const auto path = temp_path("averaged_model_export");
  emakit::export_state(ema, emakit::Peer::averaged_model, path);
  const fs::path held = save_averages(ema, "averaged_model_held");
  CHECK(check_in_python(path, held, "averaged_model") == 0);
  fs::remove(path);
  fs::remove(held);
}

TEST_CASE("timm ModelEmaV3: a run saved in Python continues in C++, the export loads in Python",
          "[conformance][interop][timm]") {
  const auto dir = scenario_dir("timm_peer", "warmup_with_step");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::timm_model_ema_v3(
      sources, {.decay = 0.99, .min_decay = 0.1, .update_after_step = 2, .use_warmup = true, .warmup_power = 0.75});
  CHECK(emakit::import_state(ema, emakit::Peer::timm_v3, step_file(*dir, "state", 25).string()).clean());
  require_counts(replay(*dir, sources, ema, /*pass_step=*/true, no_counters, kLerp, false, 26), *dir, 26);

  const auto path = temp_path("timm_export");
  emakit::export_state(ema, emakit::Peer::timm_v3, path);
  const fs::path held = save_averages(ema, "timm_held");
  CHECK(check_in_python(path, held, "timm_v3") == 0);
  fs::remove(path);
  fs::remove(held);
}

TEST_CASE("Importing a file that is not a peer's state is an error naming the file", "[conformance][interop]") {
  const auto dir = scenario_dir("averaged_model_peer", "ema_no_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::ema_pytorch(sources);
  const auto before = ema.averages()["lin.weight"].clone();
  const auto path = (*dir / "state_0012.pt").string();  // an AveragedModel state: no 'step' / 'initted'
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::ema_pytorch, path),
                    Catch::Matchers::Contains("state_0012.pt") && Catch::Matchers::Contains("ema-pytorch"));
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::ema_pytorch, "/nonexistent/ema.pt"),
                    Catch::Matchers::Contains("/nonexistent/ema.pt"));
  CHECK(torch::equal(ema.averages()["lin.weight"], before));
  CHECK(ema.num_updates() == 0);
}
