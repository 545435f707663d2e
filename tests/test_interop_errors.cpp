// import_state's and the checkpoint readers' messages for files that are not what they expect,
// without Python (the files are written here, as plain dicts; the real packages' files are
// tests/conformance/test_interop.cpp's): each names the path and the key the peer's file should
// hold, never emakit's own key (average.<name>), says what the file holds instead, and loads
// nothing.
#include <emakit/emakit.hpp>
#include <emakit/interop.hpp>

#include "helpers.hpp"

#include <ATen/ops/zeros.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

using Catch::Matchers::Contains;

namespace {

// A dict file name -> tensor, as Python's torch.save(dict(...)) writes it.
void write_dict(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& entries) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [key, value] : entries) dict.insert(key, value);
  emakit::detail::write_tensor_dict(path, dict);
}

using emakit_test::same_averages;
using emakit_test::snapshot;
using emakit_test::TempDir;
using emakit_test::TinyNet;

// The tensors an EMA holds under prefix + name, floating ones plus 0.25: what a peer saves.
std::vector<std::pair<std::string, at::Tensor>> peer_tensors(const emakit::StateDict& averages,
                                                             const std::string& prefix) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : averages) {
    const at::Tensor& t = item.value();
    out.emplace_back(prefix + item.key(), t.is_floating_point() ? t + 0.25 : t.clone());
  }
  return out;
}

}  // namespace

TEST_CASE("A directory or a missing path given as a checkpoint is named as such", "[interop][checkpoint][errors]") {
  TempDir dir;
  TinyNet model;
  auto ema = emakit::ema_pytorch(*model);
  const auto folder = dir.path / "run";
  std::filesystem::create_directories(folder);
  // Before: "refusing '...': it is not a readable zip archive (truncated or damaged?)".
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::ema_pytorch, folder),
                    Contains("import_state: '" + folder.string() + "' is a directory, not a checkpoint file"));
  CHECK_THROWS_WITH(emakit::load(ema, folder),
                    Contains("emakit::load: '" + folder.string() + "' is a directory, not a checkpoint file"));
  const auto missing = dir.path / "missing.pt";
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::ema_pytorch, missing),
                    Contains("'" + missing.string() + "': the path does not exist"));
  CHECK_THROWS_WITH(emakit::load(ema, missing), Contains("'" + missing.string() + "': the path does not exist"));
  CHECK(ema.num_updates() == 0);
}

TEST_CASE("timm: ema.module.state_dict() (keys without module.) imports as timm's own checkpoints hold it",
          "[interop][timm]") {
  TempDir dir;
  TinyNet model;
  auto ema = emakit::timm_model_ema_v3(*model);
  const auto file = dir.path / "timm.pt";
  const auto saved = peer_tensors(ema.averages(), "");
  write_dict(file, saved);
  // Before: "missing key 'average.fc.weight'".
  CHECK(emakit::import_state(ema, emakit::Peer::timm_v3, file).clean());
  const auto averages = ema.averages();
  std::size_t compared = 0;
  for (const auto& [name, value] : saved) {
    CHECK(torch::equal(averages[name], value));
    ++compared;
  }
  CHECK(compared == averages.size());
  CHECK(compared >= 7);  // fc (2), bn (4 floating, num_batches_tracked if held), scale
}

TEST_CASE("import_state names the key the peer's file should hold, and what it holds instead", "[interop][errors]") {
  TempDir dir;
  TinyNet model;
  const auto file = dir.path / "ema.pt";

  SECTION("timm: one tensor short of ema.module.state_dict()") {
    auto ema = emakit::timm_model_ema_v3(*model);
    auto saved = peer_tensors(ema.averages(), "");
    saved.erase(saved.begin());  // no fc.weight
    write_dict(file, saved);
    const auto before = snapshot(ema.averages());
    try {
      emakit::import_state(ema, emakit::Peer::timm_v3, file);
      FAIL("imported a file that lacks a tensor");
    } catch (const std::exception& e) {
      const std::string m = e.what();
      CHECK_THAT(m, Contains("'" + file.string() + "' is not a timm ModelEmaV3 state of this EMA's model"));
      CHECK_THAT(m, Contains("no 'module.fc.weight'"));  // the peer's key
      CHECK_THAT(m, Contains("no 'module.fc.bias'"));    // every key: the file holds none with module.
      CHECK_THAT(m, Contains("it holds 'fc.bias' instead: saved from ema.module.state_dict()?"));
      CHECK_THAT(m, Contains("nothing was loaded"));
      CHECK_THAT(m, !Contains("average."));  // never emakit's own key
    }
    CHECK(same_averages(ema.averages(), before));
  }

  SECTION("ema-pytorch: a tensor the file lacks, another of another shape; lenient reports them in its keys") {
    auto ema = emakit::ema_pytorch(*model);
    auto saved = peer_tensors(ema.averages(), "ema_model.");
    REQUIRE(saved[1].first == "ema_model.fc.bias");
    saved.erase(saved.begin() + 1);  // no ema_model.fc.bias
    REQUIRE(saved[1].first == "ema_model.bn.weight");
    saved[1].second = at::zeros({3});  // ema_model.bn.weight: [3], not [4]
    saved.emplace_back("step", at::scalar_tensor(4, at::kLong));
    saved.emplace_back("initted", at::scalar_tensor(true, at::kBool));
    write_dict(file, saved);
    const auto before = snapshot(ema.averages());
    try {
      emakit::import_state(ema, emakit::Peer::ema_pytorch, file);
      FAIL("imported a file that lacks a tensor");
    } catch (const std::exception& e) {
      const std::string m = e.what();
      CHECK_THAT(m, Contains("no 'ema_model.fc.bias'"));
      CHECK_THAT(m, Contains("ema_model.bn.weight: shape [3] in the file, [4] in this EMA"));
      CHECK_THAT(m, !Contains("average."));
    }
    CHECK(same_averages(ema.averages(), before));

    const auto report = emakit::import_state(ema, emakit::Peer::ema_pytorch, file, emakit::LoadMode::lenient);
    CHECK(report.missing == std::vector<std::string>{"ema_model.fc.bias"});
    REQUIRE(report.mismatched.size() == 1);
    CHECK_THAT(report.mismatched[0], Contains("ema_model.bn.weight: shape [3]"));
    // The others loaded; the missing and mismatched ones kept their values.
    CHECK(torch::equal(ema.averages()["fc.weight"], saved[0].second));
    CHECK(torch::equal(ema.averages()["fc.bias"], before.at("fc.bias")));
    CHECK(torch::equal(ema.averages()["bn.weight"], before.at("bn.weight")));
    CHECK(ema.step() == 4);
  }

  SECTION("ema-pytorch and AveragedModel: the averaged model saved alone lacks the counters, and the message says so") {
    auto ema = emakit::ema_pytorch(*model);
    write_dict(file, peer_tensors(ema.averages(), ""));
    CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::ema_pytorch, file),
                      Contains("has no 'step' and 'initted': not an ema-pytorch EMA state") &&
                          Contains("saved from ema.ema_model.state_dict()? Save torch.save(ema.state_dict(), path)"));
    auto averaged = emakit::averaged_model_ema(*model, {.decay = 0.95});
    CHECK_THROWS_WITH(emakit::import_state(averaged, emakit::Peer::averaged_model, file),
                      Contains("has no 'n_averaged'") && Contains("saved from averaged_model.module.state_dict()?"));
    CHECK(ema.num_updates() == 0);
    CHECK(averaged.num_updates() == 0);
  }

  SECTION("a counter that is not one integer is named with what it holds, and nothing loads") {
    auto ema = emakit::ema_pytorch(*model);
    const auto before = snapshot(ema.averages());
    auto saved = peer_tensors(ema.averages(), "ema_model.");
    saved.emplace_back("step", at::full({2}, 4.5));  // two floats where ema-pytorch keeps one integer
    saved.emplace_back("initted", at::scalar_tensor(true, at::kBool));
    write_dict(file, saved);
    CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::ema_pytorch, file),
                      Contains("import_state: '" + file.string() +
                               "': 'step' must be one integer, got a Float tensor "
                               "of shape [2]"));
    auto averaged = emakit::averaged_model_ema(*model, {.decay = 0.95});
    auto saved_averaged = peer_tensors(averaged.averages(), "module.");
    saved_averaged.emplace_back("n_averaged", at::zeros({3}, at::kLong));
    write_dict(file, saved_averaged);
    CHECK_THROWS_WITH(emakit::import_state(averaged, emakit::Peer::averaged_model, file),
                      Contains("'n_averaged' must be one integer, got a Long tensor of shape [3]"));
    CHECK(same_averages(ema.averages(), before));
    CHECK(ema.num_updates() == 0);
    CHECK(averaged.num_updates() == 0);
  }

  SECTION("a state of another peer: the key it holds instead is named") {
    auto ema = emakit::ema_pytorch(*model);
    auto saved = peer_tensors(ema.averages(), "module.");
    saved.emplace_back("step", at::scalar_tensor(4, at::kLong));
    saved.emplace_back("initted", at::scalar_tensor(true, at::kBool));
    write_dict(file, saved);
    CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::ema_pytorch, file),
                      Contains("no 'ema_model.fc.weight'") && Contains("it holds 'module.fc.weight' instead"));
  }
}
