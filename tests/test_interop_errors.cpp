// import_state's and the checkpoint readers' messages for files that are not what they expect,
// without Python (the files are written here, as plain dicts; the real packages' files are
// tests/conformance/test_interop.cpp's): each names the path and the key the peer's file should
// hold, never emakit's own key (average.<name>), says what the file holds instead, and loads
// nothing.
#include <emakit/emakit.hpp>
#include <emakit/interop.hpp>

#include "helpers.hpp"

#include <ATen/ops/zeros.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace test_interop_errors {  // this file's names (unity batches: tests/CMakeLists.txt)

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

namespace {

// EMAModel(model.parameters()).state_dict() as Python's torch.save writes it: the config as Python
// float, int and bool, shadow_params a list (each parameter plus 0.25, in parameters() order).
struct DiffusersFile {
  std::vector<at::Tensor> shadow;
  std::vector<std::pair<std::string, c10::IValue>> config{
      {"decay", 0.9999},         {"min_decay", 0.0}, {"optimization_step", 5}, {"update_after_step", 0},
      {"use_ema_warmup", false}, {"inv_gamma", 1.0}, {"power", 2.0 / 3.0}};
  explicit DiffusersFile(torch::nn::Module& model) {
    for (const auto& p : model.parameters()) shadow.push_back(p.detach() + 0.25);
  }
  void set(const std::string& key, c10::IValue value) {
    for (auto& [k, v] : config)
      if (k == key) v = std::move(value);
  }
  void write(const std::filesystem::path& path) const {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, value] : config) dict.insert(key, value);
    c10::impl::GenericList list(c10::AnyType::get());
    for (const auto& t : shadow) list.push_back(t);
    dict.insert("shadow_params", list);
    emakit::detail::write_tensor_dict(path, dict);
  }
};

}  // namespace

TEST_CASE("diffusers: shadow_params import by position, and the export is EMAModel.state_dict()'s dict",
          "[interop][diffusers]") {
  TempDir dir;
  TinyNet model;
  auto ema = emakit::diffusers_ema_model(*model);
  const auto file = dir.path / "ema.pt";
  const DiffusersFile saved(*model);
  saved.write(file);
  CHECK(emakit::import_state(ema, emakit::Peer::diffusers, file).clean());
  CHECK(ema.step() == 5);
  const auto averages = ema.averages();
  REQUIRE(averages.size() == 4);  // parameters only: fc.weight, fc.bias, bn.weight, bn.bias
  std::size_t compared = 0;
  for (const auto& item : averages) {
    INFO(item.key());
    CHECK(torch::equal(item.value(), saved.shadow[compared]));  // position i: the i-th parameter
    ++compared;
  }
  CHECK(compared == saved.shadow.size());

  ema.update();
  const auto exported = dir.path / "export.pt";
  emakit::export_state(ema, emakit::Peer::diffusers, exported);
  const auto dict = emakit::detail::read_pickle_dict(exported, "test");
  CHECK(dict.size() == 8);
  CHECK(dict.at("decay").isDouble());
  CHECK(dict.at("decay").toDouble() == 0.9999);
  CHECK(dict.at("min_decay").isDouble());  // EMAModel.load_state_dict: isinstance(min_decay, float)
  CHECK(dict.at("min_decay").toDouble() == 0.0);
  CHECK(dict.at("optimization_step").isInt());
  CHECK(dict.at("optimization_step").toInt() == 6);
  CHECK(dict.at("update_after_step").isInt());
  CHECK(dict.at("update_after_step").toInt() == 0);
  CHECK(dict.at("use_ema_warmup").isBool());
  CHECK_FALSE(dict.at("use_ema_warmup").toBool());
  CHECK(dict.at("inv_gamma").isDouble());
  CHECK(dict.at("power").isDouble());
  REQUIRE(dict.at("shadow_params").isList());
  const auto shadow = dict.at("shadow_params").toListRef();
  REQUIRE(shadow.size() == 4);
  std::size_t exported_compared = 0;
  for (const auto& item : ema.averages()) {
    CHECK(torch::equal(shadow[exported_compared].toTensor(), item.value()));
    ++exported_compared;
  }
  CHECK(exported_compared == 4);
}

TEST_CASE("diffusers: a list of another length or shape, or another config, is named and loads nothing",
          "[interop][diffusers][errors]") {
  TempDir dir;
  TinyNet model;
  const auto file = dir.path / "ema.pt";
  auto ema = emakit::diffusers_ema_model(*model, {.decay = 0.999, .min_decay = 0.05, .update_after_step = 2});
  const auto before = snapshot(ema.averages());
  DiffusersFile saved(*model);
  saved.set("decay", 0.999);
  saved.set("min_decay", 0.05);
  saved.set("update_after_step", 2);
  auto refused = [&](const DiffusersFile& f, emakit::LoadMode mode = emakit::LoadMode::strict) {
    f.write(file);
    try {
      emakit::import_state(ema, emakit::Peer::diffusers, file, mode);
    } catch (const std::exception& e) {
      CHECK(same_averages(ema.averages(), before));
      CHECK(ema.step() == 0);
      return std::string(e.what());
    }
    FAIL("imported a file it should refuse");
    return std::string();
  };

  SECTION("one tensor short") {
    auto f = saved;
    f.shadow.pop_back();
    const auto m = refused(f);
    CHECK_THAT(m,
               Contains("import_state: '" + file.string() + "': shadow_params holds 3 tensors, this EMA averages 4"));
    CHECK_THAT(m, Contains("matched by position to this EMA's averaged tensors, the model's parameters() order"));
    CHECK_THAT(m, Contains("nothing was loaded"));
    CHECK_THAT(refused(f, emakit::LoadMode::lenient), Contains("shadow_params holds 3 tensors"));  // no lenient
  }

  SECTION("the list in another order: the position, the name it matched and both shapes") {
    auto f = saved;
    std::swap(f.shadow[0], f.shadow[1]);  // fc.bias [4] where fc.weight [4, 3] is
    const auto m = refused(f);
    CHECK_THAT(m, Contains("shadow_params[0] (matched to 'fc.weight' by position) has shape [4] in the file, "
                           "[4, 3] in this EMA"));
    CHECK_THAT(m, !Contains("average."));
  }

  SECTION("a dtype that differs at a position") {
    auto f = saved;
    f.shadow[2] = f.shadow[2].to(at::kDouble);
    CHECK_THAT(refused(f), Contains("shadow_params[2] (matched to 'bn.weight' by position) has dtype Double in the "
                                    "file, Float in this EMA"));
  }

  SECTION("a config entry that differs names the field and both values") {
    auto f = saved;
    f.set("min_decay", 0.1);
    CHECK_THAT(refused(f), Contains("config differs: min_decay is 0.1 in the file, 0.05 in this EMA "
                                    "(RationalRamp::min_decay)"));
    CHECK_THAT(refused(f, emakit::LoadMode::lenient), Contains("config differs: min_decay"));
    f = saved;
    f.set("update_after_step", 3);
    CHECK_THAT(refused(f), Contains("config differs: update_after_step is 3 in the file, 2 in this EMA"));
    f = saved;
    f.set("use_ema_warmup", true);
    CHECK_THAT(refused(f), Contains("config differs: use_ema_warmup is True in the file, False in this EMA"));
    f = saved;
    f.set("decay", 0.9999);
    CHECK_THAT(refused(f), Contains("config differs: decay is 0.9999 in the file, 0.999 in this EMA "
                                    "(RationalRamp::decay_max)"));
  }

  SECTION("a counter of another type, and a missing entry") {
    auto f = saved;
    f.set("optimization_step", 2.5);
    CHECK_THAT(refused(f), Contains("'optimization_step' must be an int, got 2.5"));
    f = saved;
    f.config.erase(f.config.begin() + 2);  // no optimization_step
    CHECK_THAT(refused(f), Contains("has no 'optimization_step': not a diffusers EMAModel state"));
  }

  SECTION("an EMA whose decay no EMAModel file describes") {
    auto other = emakit::averaged_model_ema(*model, {.decay = 0.95});
    saved.write(file);
    CHECK_THROWS_WITH(emakit::import_state(other, emakit::Peer::diffusers, file),
                      Contains("Peer::diffusers needs an EMA made by diffusers_ema_model"));
    CHECK_THROWS_WITH(emakit::export_state(other, emakit::Peer::diffusers, dir.path / "other.pt"),
                      Contains("export_state: Peer::diffusers needs an EMA made by diffusers_ema_model"));
    CHECK_FALSE(std::filesystem::exists(dir.path / "other.pt"));
  }
}

TEST_CASE("luxonis-train: EMACallback.state_dict() imports by name with its updates, and another file is named",
          "[interop][luxonis][errors]") {
  TempDir dir;
  TinyNet model;
  auto ema = emakit::luxonis_model_ema(*model, {.decay = 0.99, .decay_tau = 5.0});
  const auto file = dir.path / "callback.pt";
  const auto saved = peer_tensors(ema.averages(), "");
  auto write = [&](const c10::IValue& updates, const char* tensors_key = "ema_state_dict") {
    c10::impl::GenericDict inner(c10::StringType::get(), c10::TensorType::get());
    for (const auto& [key, value] : saved) inner.insert(key, value);
    c10::impl::GenericDict outer(c10::StringType::get(), c10::AnyType::get());
    outer.insert(tensors_key, inner);
    outer.insert("updates", updates);
    emakit::detail::write_tensor_dict(file, outer);
  };
  const auto before = snapshot(ema.averages());

  write(c10::IValue(2.5));  // updates: a float, which EMACallback would ignore
  CHECK_THROWS_WITH(
      emakit::import_state(ema, emakit::Peer::luxonis_callback, file),
      Contains("import_state: '" + file.string() + "': 'updates' must be an int, got 2.5; nothing was loaded"));
  write(c10::IValue(std::int64_t{7}), "state_dict");
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::luxonis_callback, file),
                    Contains("has no 'ema_state_dict': not a luxonis-train EMACallback state (save it with "
                             "torch.save(callback.state_dict(), path)"));
  CHECK(same_averages(ema.averages(), before));
  CHECK(ema.num_updates() == 0);

  write(c10::IValue(std::int64_t{7}));
  CHECK(emakit::import_state(ema, emakit::Peer::luxonis_callback, file).clean());
  CHECK(ema.num_updates() == 7);
  CHECK(ema.step() == 7);
  std::size_t compared = 0;
  for (const auto& [name, value] : saved) {
    CHECK(torch::equal(ema.averages()[name], value));
    ++compared;
  }
  CHECK(compared == ema.averages().size());
}

TEST_CASE("lightning: a checkpoint without averaging_state, of another shape or other counters loads nothing",
          "[interop][lightning][errors]") {
  TempDir dir;
  TinyNet model;
  // update_every_n_steps = 2 from the first step: updates at steps 1, 3, 5 of 6.
  auto ema = emakit::lightning_ema_weight_averaging(*model, {.decay = 0.9, .update_every_n_steps = 2});
  const auto file = dir.path / "last.ckpt";
  const auto saved = peer_tensors(ema.averages(), "");
  // What trainer.save_checkpoint writes with EMAWeightAveraging, less Lightning's own entries.
  auto write = [&](bool averaging, std::int64_t n_averaged, std::int64_t latest, const std::string& reshaped = "") {
    c10::impl::GenericDict state(c10::StringType::get(), c10::TensorType::get());
    for (const auto& [key, value] : saved) state.insert(key, key == reshaped ? value.reshape({-1, 1}) : value);
    c10::impl::GenericDict ckpt(c10::StringType::get(), c10::AnyType::get());
    ckpt.insert("state_dict", state);
    ckpt.insert("global_step", std::int64_t{6});
    ckpt.insert("epoch", std::int64_t{0});
    if (averaging) {
      c10::impl::GenericDict avg(c10::StringType::get(), c10::TensorType::get());
      avg.insert("n_averaged", at::scalar_tensor(n_averaged, at::kLong));
      ckpt.insert("averaging_state", avg);
    }
    c10::impl::GenericDict fields(c10::StringType::get(), c10::AnyType::get());
    fields.insert("latest_update_step", latest);
    c10::impl::GenericDict callbacks(c10::StringType::get(), c10::AnyType::get());
    callbacks.insert("EMAWeightAveraging", fields);
    ckpt.insert("callbacks", callbacks);
    emakit::detail::write_tensor_dict(file, ckpt);
  };
  const auto before = snapshot(ema.averages());
  const auto unchanged = [&] {
    CHECK(same_averages(ema.averages(), before));
    CHECK(ema.num_updates() == 0);
    CHECK(ema.step() == 0);
  };

  write(false, 3, 5);  // saved without the callback: state_dict is the model's weights
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::lightning, file),
                    Contains("import_state: '" + file.string() +
                             "' has no 'averaging_state': not written with Lightning's EMAWeightAveraging callback") &&
                        Contains("nothing was loaded"));
  unchanged();
  const std::string first = saved.front().first;
  write(true, 3, 5, first);
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::lightning, file),
                    Contains("is not a Lightning EMAWeightAveraging checkpoint state of this EMA's model") &&
                        Contains(first) && Contains("nothing was loaded"));
  unchanged();
  write(true, 6, 6);  // every step: made with update_every_n_steps = 1
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::lightning, file),
                    Contains("n_averaged is 6 in the file, but this EMA's schedule makes 3 updates in global_step 6 "
                             "steps: made with other EMAWeightAveraging options"));
  unchanged();
  write(true, 3, 6);
  CHECK_THROWS_WITH(
      emakit::import_state(ema, emakit::Peer::lightning, file),
      Contains("latest_update_step is 6 in the file, but this EMA's schedule last updates at step 5 of 6"));
  unchanged();

  write(true, 3, 5);
  CHECK(emakit::import_state(ema, emakit::Peer::lightning, file).clean());
  CHECK(ema.step() == 6);
  CHECK(ema.num_updates() == 3);
  CHECK(ema.last_update_step() == 5);
  std::size_t compared = 0;
  for (const auto& [name, value] : saved) {
    CHECK(torch::equal(ema.averages()[name], value));
    ++compared;
  }
  CHECK(compared == ema.averages().size());
  CHECK(compared > 0);

  // The export: the four entries, in the types the callback and Lightning write them.
  const auto exported = dir.path / "ema.ckpt";
  emakit::export_state(ema, emakit::Peer::lightning, exported);
  const auto read = emakit::detail::read_pickle_dict(exported, "test");
  REQUIRE(read.size() == 4);
  CHECK(read.at("global_step").toInt() == 6);
  CHECK(read.at("averaging_state").toGenericDict().at("n_averaged").toTensor().scalar_type() == at::kLong);
  CHECK(read.at("averaging_state").toGenericDict().at("n_averaged").toTensor().item<std::int64_t>() == 3);
  CHECK(
      read.at("callbacks").toGenericDict().at("EMAWeightAveraging").toGenericDict().at("latest_update_step").toInt() ==
      5);
  const auto tensors = read.at("state_dict").toGenericDict();
  CHECK(tensors.size() == saved.size());
  for (const auto& [name, value] : saved) CHECK(torch::equal(tensors.at(name).toTensor(), value));
}

TEST_CASE("nvalchemi: EMAHook.state_dict() imports with the trainer's step, and a file of other options loads nothing",
          "[interop][nvalchemi][errors]") {
  TempDir dir;
  TinyNet model;
  const emakit::NvalchemiEmaOptions options{.decay = 0.9, .update_every = 2, .start_step = 3, .use_buffers = false};
  auto ema = emakit::nvalchemi_ema(*model, options);
  torch::manual_seed(3);
  for (int step = 1; step <= 7; ++step) {  // eligible completed steps 4 and 6: a copy, then an average
    emakit_test::perturb(*model);
    ema.update();
  }
  REQUIRE(ema.num_updates() == 2);
  REQUIRE(ema.last_update_step() == 6);
  const auto file = dir.path / "hook.pt";
  emakit::export_state(ema, emakit::Peer::nvalchemi_hook, file);

  // What EMAHook.state_dict() holds, less model_key: the config's Python types, num_updates, and
  // the AveragedModel's state (module.<name>, n_averaged).
  const auto exported = emakit::detail::read_pickle_dict(file, "test");
  CHECK(exported.size() == 6);
  CHECK(exported.at("decay").isDouble());
  CHECK(exported.at("decay").toDouble() == 0.9);
  CHECK(exported.at("update_every").toInt() == 2);
  CHECK(exported.at("start_step").toInt() == 3);
  CHECK(exported.at("use_buffers").isBool());
  CHECK_FALSE(exported.at("use_buffers").toBool());
  CHECK(exported.at("num_updates").isInt());
  CHECK(exported.at("num_updates").toInt() == 2);
  CHECK_FALSE(exported.contains("model_key"));
  const auto inner = exported.at("averaged_model_state").toGenericDict();
  CHECK(inner.size() == ema.averages().size() + 1);
  const at::Tensor n_averaged = inner.at("n_averaged").toTensor();
  CHECK(n_averaged.scalar_type() == at::kLong);
  CHECK(n_averaged.item<std::int64_t>() == 2);
  std::size_t written = 0;
  for (const auto& item : ema.averages()) {
    INFO(item.key());
    CHECK(torch::equal(inner.at("module." + item.key()).toTensor(), item.value()));
    ++written;
  }
  CHECK(written == ema.averages().size());

  // A copy of the exported dict with `key` set to `value` (or erased), written to `to`.
  const auto edited = [&](const std::string& key, const std::optional<c10::IValue>& value,
                          const std::filesystem::path& to) {
    auto d = exported.copy();
    if (value) {
      d.insert_or_assign(key, *value);
    } else {
      REQUIRE(d.erase(key) == 1);
    }
    emakit::detail::write_tensor_dict(to, d);
    return to;
  };
  TinyNet other_model;
  auto fresh = emakit::nvalchemi_ema(*other_model, options);
  const auto before = snapshot(fresh.averages());
  const auto refused = [&](const std::filesystem::path& f, const emakit::ImportOptions& o) -> std::string {
    try {
      emakit::import_state(fresh, emakit::Peer::nvalchemi_hook, f, o);
    } catch (const std::exception& e) {
      CHECK(same_averages(fresh.averages(), before));
      CHECK(fresh.num_updates() == 0);
      CHECK(fresh.step() == 0);
      return e.what();
    }
    FAIL("import_state accepted " << f);
    return {};
  };

  SECTION("the trainer's step is required, and must give the file's num_updates") {
    CHECK_THAT(refused(file, {}),
               Contains("an nvalchemi EMAHook state holds no step") && Contains("{.step = step_count}"));
    CHECK_THAT(refused(file, {.step = 5}), Contains("num_updates is 2 in the file, but this EMA's schedule makes 1 "
                                                    "updates in 5 completed steps"));
    CHECK_THAT(refused(file, {.step = 8}), Contains("makes 3 updates in 8 completed steps"));
    CHECK_THAT(refused(file, {.step = -1}), Contains("ImportOptions::step must be >= 0, got -1"));
  }

  SECTION("a config entry that differs is named with both values") {
    CHECK_THAT(refused(edited("decay", c10::IValue(0.95), dir.path / "d.pt"), {.step = 7}),
               Contains("config differs: decay is 0.95 in the file, 0.9 in this EMA (Fixed::beta)"));
    CHECK_THAT(refused(edited("update_every", c10::IValue(std::int64_t{3}), dir.path / "u.pt"), {.step = 7}),
               Contains("config differs: update_every is 3 in the file, 2 in this EMA"));
    CHECK_THAT(refused(edited("start_step", c10::IValue(std::int64_t{0}), dir.path / "s.pt"), {.step = 7}),
               Contains("config differs: start_step is 0 in the file, 3 in this EMA"));
    CHECK_THAT(refused(edited("use_buffers", c10::IValue(true), dir.path / "b.pt"), {.step = 7}),
               Contains("config differs: use_buffers is True in the file, False in this EMA (buffers copied)"));
    CHECK_THAT(refused(edited("update_every", c10::IValue(2.0), dir.path / "f.pt"), {.step = 7}),
               Contains("'update_every' must be an int, got 2"));
  }

  SECTION("counters that disagree, a state saved before the first update, a missing tensor") {
    CHECK_THAT(refused(edited("num_updates", c10::IValue(std::int64_t{3}), dir.path / "n.pt"), {.step = 7}),
               Contains("num_updates is 3 but averaged_model_state's n_averaged is 2"));
    CHECK_THAT(refused(edited("averaged_model_state", std::nullopt, dir.path / "a.pt"), {.step = 7}),
               Contains("has no 'averaged_model_state': the hook had not made its averaged model yet"));
    auto missing = inner.copy();
    REQUIRE(missing.erase("module.fc.weight") == 1);
    CHECK_THAT(refused(edited("averaged_model_state", c10::IValue(missing), dir.path / "m.pt"), {.step = 7}),
               Contains("is not an nvalchemi EMAHook state of this EMA's model: in averaged_model_state, no "
                        "'module.fc.weight'"));
    CHECK_THAT(refused(edited("num_updates", std::nullopt, dir.path / "k.pt"), {.step = 7}),
               Contains("has no 'num_updates': not an nvalchemi EMAHook state"));
  }

  SECTION("a step given for a peer whose file holds its own, an EMA no EMAHook describes") {
    auto pytorch = emakit::ema_pytorch(*other_model);
    CHECK_THROWS_WITH(emakit::import_state(pytorch, emakit::Peer::ema_pytorch, file, {.step = 7}),
                      Contains("ImportOptions::step (7) is for Peer::nvalchemi_hook, whose file holds no step; an "
                               "ema-pytorch EMA file holds its own counters"));
    CHECK_THROWS_WITH(emakit::import_state(pytorch, emakit::Peer::nvalchemi_hook, file, {.step = 7}),
                      Contains("import_state: Peer::nvalchemi_hook needs an EMA made by nvalchemi_ema"));
    CHECK_THROWS_WITH(emakit::export_state(pytorch, emakit::Peer::nvalchemi_hook, dir.path / "x.pt"),
                      Contains("export_state: Peer::nvalchemi_hook needs an EMA made by nvalchemi_ema"));
    CHECK_FALSE(std::filesystem::exists(dir.path / "x.pt"));
  }

  SECTION("with the trainer's step, the import is the hook's state and the run goes on as one that never stopped") {
    CHECK(emakit::import_state(fresh, emakit::Peer::nvalchemi_hook, file, {.step = 7}).clean());
    CHECK(fresh.step() == 7);
    CHECK(fresh.num_updates() == 2);
    CHECK(fresh.last_update_step() == 6);
    CHECK(same_averages(fresh.averages(), snapshot(ema.averages())));
    // Steps 8..11 with the same model on both: updates at 8 and 10 on both.
    const auto follow = [&] {
      torch::NoGradGuard no_grad;
      auto to = other_model->named_parameters();
      for (const auto& p : model->named_parameters()) to[p.key()].copy_(p.value());
      auto to_buffers = other_model->named_buffers();
      for (const auto& b : model->named_buffers()) to_buffers[b.key()].copy_(b.value());
    };
    for (int step = 8; step <= 11; ++step) {
      emakit_test::perturb(*model);
      follow();
      ema.update();
      fresh.update();
    }
    CHECK(fresh.num_updates() == 4);
    CHECK(ema.num_updates() == 4);
    CHECK(same_averages(fresh.averages(), snapshot(ema.averages())));
  }
}

namespace {
// An embedding whose weight is also registered as the output head's (a language model's tie).
struct TiedLmImpl : torch::nn::Module {
  TiedLmImpl() {
    emb = register_module("emb", torch::nn::Embedding(10, 4));
    lin = register_module("lin", torch::nn::Linear(4, 3));
    register_parameter("head_weight", emb->weight);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(TiedLm);
}  // namespace

TEST_CASE("diffusers: a tied weight is one entry of shadow_params, as model.parameters() lists it, both ways",
          "[interop][diffusers][ties]") {
  TempDir dir;
  TiedLm model;
  auto ema = emakit::diffusers_ema_model(*model, {.decay = 0.9});
  torch::manual_seed(5);
  for (int step = 1; step <= 3; ++step) {
    emakit_test::perturb(*model);
    ema.update();
  }
  REQUIRE(ema.averages().size() == 4);  // emb.weight, lin.weight, lin.bias and head_weight, one of them tied
  const auto file = dir.path / "ema.pt";
  emakit::export_state(ema, emakit::Peer::diffusers, file);
  const auto exported = emakit::detail::read_pickle_dict(file, "test");
  const auto shadow = exported.at("shadow_params").toListRef();
  REQUIRE(shadow.size() == 3);
  std::size_t matched = 0;
  for (const auto& item : ema.averages()) {
    INFO(item.key());
    std::size_t equal = 0;
    for (const auto& s : shadow) equal += emakit_test::bitwise_equal(s.toTensor(), item.value()) ? 1 : 0;
    CHECK(equal == 1);  // each name's average is in the list once (the tied two are one entry)
    ++matched;
  }
  CHECK(matched == 4);

  TiedLm other;
  auto fresh = emakit::diffusers_ema_model(*other, {.decay = 0.9});
  CHECK(emakit::import_state(fresh, emakit::Peer::diffusers, file).clean());
  CHECK(fresh.step() == 3);
  CHECK(same_averages(fresh.averages(), snapshot(ema.averages())));
  // Still one average under both names: it moves under both when the model moves.
  const at::Tensor tied = fresh.averages()["emb.weight"];
  CHECK(fresh.averages()["head_weight"].data_ptr() == tied.data_ptr());
  emakit_test::perturb(*other);
  fresh.update();
  CHECK(emakit_test::bitwise_equal(fresh.averages()["head_weight"], fresh.averages()["emb.weight"]));

  // A list with the tied weight twice (four entries) is a state of another model.
  auto d = exported.copy();
  c10::impl::GenericList four(c10::AnyType::get());
  for (const auto& s : shadow) four.push_back(s);
  four.push_back(shadow[0]);
  d.insert_or_assign("shadow_params", four);
  emakit::detail::write_tensor_dict(dir.path / "four.pt", d);
  TiedLm third;
  auto refused = emakit::diffusers_ema_model(*third, {.decay = 0.9});
  const auto before = snapshot(refused.averages());
  CHECK_THROWS_WITH(emakit::import_state(refused, emakit::Peer::diffusers, dir.path / "four.pt"),
                    Contains("shadow_params holds 4 tensors, this EMA averages 3 distinct ones (and 1 tied name)"));
  CHECK(same_averages(refused.averages(), before));
}

namespace {

// The name of Peer's enumerator of value V ("ema_pytorch"), or "" when no enumerator has it: the
// compiler spells a template argument by its enumerator's name, and another value as a cast,
// "(emakit::header_only::Peer)7".
template <emakit::Peer V>
constexpr std::string_view enumerator_name() {
  const std::string_view signature = __PRETTY_FUNCTION__;
  const std::string_view marker = "V = ";
  const std::size_t start = signature.find(marker) + marker.size();
  const std::string_view value = signature.substr(start, signature.find_first_of(";]", start) - start);
  if (value.empty() || value.front() == '(' || (value.front() >= '0' && value.front() <= '9')) return {};
  return value.substr(value.rfind(':') + 1);
}
static_assert(enumerator_name<emakit::Peer::ema_pytorch>() == "ema_pytorch" &&
                  enumerator_name<emakit::Peer::nvalchemi_hook>() == "nvalchemi_hook" &&
                  enumerator_name<static_cast<emakit::Peer>(200)>().empty(),
              "enumerator_name: this compiler spells a template argument of enum type otherwise");

// The enumerator name of each value of Peer's underlying type (std::uint8_t: all 256).
template <std::size_t... I>
std::vector<std::string_view> enumerator_names(std::index_sequence<I...>) {
  return {enumerator_name<static_cast<emakit::Peer>(I)>()...};
}

}  // namespace

namespace {

// Where an entry sits in a peer's file: the keys of the dicts down to it, then a list position
// when it is an item of a list (shadow_params[2]).
struct Place {
  std::vector<std::string> keys;
  std::optional<std::size_t> item;
  std::string text() const {
    std::string out = keys.empty() ? std::string() : "'" + keys[0] + "'";
    for (std::size_t i = 1; i < keys.size(); ++i) out += "['" + keys[i] + "']";
    return item ? fmt::format("{}[{}]", out, *item) : out;
  }
  // How a refusal names it: its last key, or the list and the position.
  std::string named() const { return item ? fmt::format("{}[{}]", keys.back(), *item) : keys.back(); }
};

// Every place in `dict`, dicts and lists followed down.
void places(const c10::impl::GenericDict& dict, std::vector<std::string>& keys, std::vector<Place>& out) {
  for (const auto& e : dict) {
    keys.push_back(e.key().toStringRef());
    out.push_back({keys, std::nullopt});
    if (e.value().isGenericDict()) places(e.value().toGenericDict(), keys, out);
    if (e.value().isList())
      for (std::size_t i = 0; i < e.value().toListRef().size(); ++i) out.push_back({keys, i});
    keys.pop_back();
  }
}

// A copy of `dict` (each level on the way copied, the rest shared) with the entry at `at` set to
// `value`, or erased (nullopt; a list item is never erased).
c10::impl::GenericDict edited(const c10::impl::GenericDict& dict, const Place& at, std::size_t depth,
                              const std::optional<c10::IValue>& value) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  for (const auto& e : dict) out.insert(e.key(), e.value());
  const std::string& key = at.keys[depth];
  if (depth + 1 < at.keys.size()) {
    out.insert_or_assign(key, edited(out.at(key).toGenericDict(), at, depth + 1, value));
  } else if (at.item) {
    c10::impl::GenericList list(c10::AnyType::get());
    for (const auto& v : out.at(key).toListRef()) list.push_back(v);
    list.set(*at.item, *value);
    out.insert_or_assign(key, list);
  } else if (value) {
    out.insert_or_assign(key, *value);
  } else {
    REQUIRE(out.erase(key) == 1);
  }
  return out;
}

}  // namespace

TEST_CASE("Every refusal of a peer's file, whatever entry is missing or of another type, has one lead and one tail",
          "[interop][errors]") {
  // Each peer's own export (after updates: counters above 0), then every entry of it, at every
  // depth, erased or replaced by each value below, one at a time. What import_state refuses must
  // be led by "import_state: '<path>'", end with "; nothing was loaded" (each once), name the
  // entry, and leave the whole state as it was; every entry must be refused for some edit (each
  // is read and checked). An accepted edit is undone before the next.
  TempDir dir;
  TinyNet model;
  std::vector<std::pair<emakit::Peer, std::unique_ptr<emakit::EmaBase>>> emas;
  const auto add = [&](emakit::Peer peer, auto ema) {
    emas.emplace_back(peer, std::make_unique<decltype(ema)>(std::move(ema)));
  };
  add(emakit::Peer::ema_pytorch, emakit::ema_pytorch(*model));
  add(emakit::Peer::timm_v3, emakit::timm_model_ema_v3(*model));
  add(emakit::Peer::averaged_model, emakit::averaged_model_ema(*model, {.decay = 0.95}));
  add(emakit::Peer::diffusers, emakit::diffusers_ema_model(*model, {.decay = 0.999, .min_decay = 0.05}));
  add(emakit::Peer::luxonis_callback, emakit::luxonis_model_ema(*model, {.decay = 0.99, .decay_tau = 5.0}));
  add(emakit::Peer::lightning, emakit::lightning_ema_weight_averaging(*model, {.decay = 0.9}));
  add(emakit::Peer::nvalchemi_hook, emakit::nvalchemi_ema(*model, {.decay = 0.9}));
  torch::manual_seed(5);
  for (int step = 0; step < 3; ++step) {
    emakit_test::perturb(*model);
    for (auto& [peer, ema] : emas) ema->update();
  }
  c10::impl::GenericDict empty(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericList ints(c10::AnyType::get());
  ints.push_back(std::int64_t{1});
  const std::vector<std::pair<const char*, c10::IValue>> values = {
      {"None", c10::IValue()},
      {"True", c10::IValue(true)},
      {"-3", c10::IValue(std::int64_t{-3})},
      {"2.5", c10::IValue(2.5)},
      {"'text'", c10::IValue("text")},
      {"a float tensor of shape [3]", at::zeros({3})},
      {"a long tensor -2", at::scalar_tensor(-2, at::kLong)},
      {"a float tensor 2.5", at::scalar_tensor(2.5)},
      {"an empty dict", empty},
      {"a list [1]", ints}};
  std::size_t refusals = 0, edits = 0, peers = 0;
  for (auto& [peer, ema] : emas) {
    const std::string id(emakit::detail::interop::codec(peer).id);
    INFO("Peer::" << id);
    const auto base = dir.path / (id + ".pt");
    emakit::export_state(*ema, peer, base);
    const emakit::ImportOptions options{
        .step = peer == emakit::Peer::nvalchemi_hook ? std::optional<std::int64_t>(ema->step()) : std::nullopt};
    const auto before = snapshot(ema->state_dict());                   // what "nothing was loaded" is checked against
    REQUIRE(emakit::import_state(*ema, peer, base, options).clean());  // the export itself imports
    REQUIRE(same_averages(ema->state_dict(), before));
    const auto exported = emakit::detail::read_pickle_dict(base, "test");
    std::vector<std::string> keys;
    std::vector<Place> all;
    places(exported, keys, all);
    REQUIRE(all.size() >= 4);
    const auto file = dir.path / (id + "_edited.pt");
    const std::string lead = "emakit: import_state: '" + file.string() + "'";
    const std::string tail = "; nothing was loaded";
    const auto count = [](const std::string& text, const std::string& part) {
      std::size_t n = 0;
      for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
      return n;
    };
    for (const Place& at : all) {
      INFO("the entry " << at.text());
      std::size_t refused = 0;
      std::vector<std::pair<std::string, std::optional<c10::IValue>>> edits_here(values.begin(), values.end());
      if (!at.item) edits_here.emplace_back("erased", std::nullopt);  // a list item is never erased
      for (const auto& [what, value] : edits_here) {
        INFO("the entry " << (value ? "set to " : "") << what);
        emakit::detail::write_tensor_dict(file, edited(exported, at, 0, value));
        ++edits;
        try {
          emakit::import_state(*ema, peer, file, options);
        } catch (const std::invalid_argument& e) {
          const std::string m = e.what();
          INFO(m);
          ++refused;
          CHECK(m.rfind(lead, 0) == 0);
          CHECK((m.size() > lead.size() && (m[lead.size()] == ':' || m[lead.size()] == ' ')));
          CHECK(m.size() >= tail.size());
          CHECK(m.compare(m.size() - tail.size(), tail.size(), tail) == 0);
          CHECK(count(m, "import_state: '") == 1);
          CHECK(count(m, "nothing was loaded") == 1);
          CHECK_THAT(m, Contains(at.named()));
          CHECK(same_averages(ema->state_dict(), before));
          continue;
        }
        emakit::StateDict undo;  // accepted: undone
        for (const auto& [key, t] : before) undo.insert(key, t.clone());
        ema->load_state_dict(undo);
      }
      CHECK(refused > 0);
      refusals += refused;
    }
    ++peers;
  }
  CHECK(peers == 7);
  // TinyNet's tensors in 7 files, each file's counters and config: 854 edits today, 839 refused
  // (the 15 accepted: values a peer's reader takes, such as a float initted, or an inv_gamma that
  // EMAModel without warmup never reads).
  CHECK(edits >= 800);
  CHECK(refusals >= 780);
}

TEST_CASE("Every Peer enumerator has one codec, named as the enumerator, and another value is refused by name",
          "[interop][errors]") {
  const std::vector<std::string_view> names = enumerator_names(std::make_index_sequence<256>());
  std::set<std::string_view> ids;
  std::optional<std::size_t> unknown;
  for (std::size_t v = 0; v < names.size(); ++v) {
    const auto peer = static_cast<emakit::Peer>(v);
    if (names[v].empty()) {
      // Before: "interop: unknown Peer value 7", from the name table; now it lists the codecs.
      CHECK_THROWS_WITH(emakit::detail::interop::codec(peer),
                        Contains(fmt::format("interop: unknown Peer value {}; emakit has a codec for ", v)) &&
                            Contains("Peer::ema_pytorch (0), Peer::timm_v3 (1)"));
      if (!unknown) unknown = v;
      continue;
    }
    INFO("Peer::" << names[v] << " (" << v << ")");
    const emakit::detail::interop::Codec& codec = emakit::detail::interop::codec(peer);
    CHECK(codec.peer == peer);
    CHECK(codec.id == names[v]);
    CHECK(ids.insert(codec.id).second);
    CHECK(codec.write != nullptr);
    CHECK(codec.read != nullptr);
    CHECK(!codec.name.empty());
    CHECK(!codec.save_call.empty());
    CHECK(!codec.inner_call.empty());
  }
  CHECK(ids.size() >= 7);  // ema_pytorch ... nvalchemi_hook: the enumerators were found
  REQUIRE(unknown);

  // Through the public calls: nothing written, nothing loaded.
  TempDir dir;
  TinyNet model;
  auto ema = emakit::ema_pytorch(*model);
  const auto bad = static_cast<emakit::Peer>(*unknown);
  const std::string message = fmt::format("interop: unknown Peer value {};", *unknown);
  CHECK_THROWS_WITH(emakit::export_state(ema, bad, dir.path / "bad.pt"), Contains(message));
  CHECK(!std::filesystem::exists(dir.path / "bad.pt"));
  emakit::export_state(ema, emakit::Peer::ema_pytorch, dir.path / "ema.pt");
  CHECK_THROWS_WITH(emakit::import_state(ema, bad, dir.path / "ema.pt"), Contains(message));
  CHECK(ema.num_updates() == 0);
}

}  // namespace test_interop_errors
