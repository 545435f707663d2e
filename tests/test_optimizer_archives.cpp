// Archives with optimizer state, as the README's recipe writes them (an EmaHook checkpoint with the
// optimizer beside it in one file), read by the checked loaders: every torch::optim optimizer, and
// archives nested two levels deep. The archive check (detail/serial/archive_scan.hpp) must accept what
// LibTorch writes for them and still refuse code hidden in the same declaration forms.
#include <emakit/emakit.hpp>

#include "archive_records.hpp"
#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <caffe2/serialize/inline_container.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <filesystem>
#include <map>
#include <cstdint>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace test_optimizer_archives {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit_test::bitwise_equal;
using emakit_test::TempDir;
using emakit_test::TinyNet;

namespace {

namespace fs = std::filesystem;

// The optimizers, each with options that give it state after one step.
struct Sgd {
  using Optimizer = torch::optim::SGD;
  static auto options() { return torch::optim::SGDOptions(0.05); }
};
struct SgdMomentum {
  using Optimizer = torch::optim::SGD;
  static auto options() { return torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true); }
};
struct Adam {
  using Optimizer = torch::optim::Adam;
  static auto options() { return torch::optim::AdamOptions(0.01).weight_decay(0.01); }
};
struct AdamW {
  using Optimizer = torch::optim::AdamW;
  static auto options() { return torch::optim::AdamWOptions(0.01).amsgrad(true); }
};
struct RMSprop {
  using Optimizer = torch::optim::RMSprop;
  static auto options() { return torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true); }
};
struct Adagrad {
  using Optimizer = torch::optim::Adagrad;
  static auto options() { return torch::optim::AdagradOptions(0.05); }
};
// LibTorch (1.13 and 2.x) cannot save an LBFGS whose history is not full yet: its state holds
// undefined tensors then, and OutputArchive::save_to throws "Cannot access storage of
// UndefinedTensorImpl". A history of 2 is full after the first step.
struct Lbfgs {
  using Optimizer = torch::optim::LBFGS;
  static auto options() { return torch::optim::LBFGSOptions(0.1).history_size(2).max_iter(5); }
};

using Weights = std::map<std::string, torch::Tensor>;

Weights weights_of(const torch::nn::Module& m) { return emakit_test::model_snapshot(m); }
Weights weights_of(const emakit::StateDict& tensors) {
  Weights out;
  for (const auto& item : tensors) out.emplace(item.key(), item.value().detach().clone());
  return out;
}
bool same(const Weights& a, const Weights& b) { return emakit_test::same_snapshot(a, b); }

// One optimizer step of a model with 3 inputs and `outputs` outputs, on data that depends on
// `step` only (LBFGS evaluates the closure several times).
template <class Net, class Optimizer>
void train_step(Net& model, Optimizer& optimizer, int step, std::int64_t outputs) {
  torch::manual_seed(1000 + step);
  const auto x = torch::randn({8, 3});
  const auto y = torch::randn({8, outputs});
  optimizer.step([&] {
    optimizer.zero_grad();
    auto loss = torch::nn::functional::mse_loss(model->forward(x), y);
    loss.backward();
    return loss;
  });
}

TinyNet seeded_net(std::uint64_t seed) {
  torch::manual_seed(seed);
  return TinyNet();
}

// A TinyNet (3 -> 4) made from `seed`, its optimizer and an EMA hook.
template <class Case>
struct Run {
  TinyNet model;
  typename Case::Optimizer optimizer;
  emakit::EmaHook hook;
  explicit Run(std::uint64_t seed) : model(seeded_net(seed)), optimizer(model->parameters(), Case::options()) {
    hook.add(*model, emakit::Recipe(emakit::Fixed(0.5)));
    hook.setup();
  }
  void train(int from, int to) {
    for (int step = from; step <= to; ++step) {
      train_step(model, optimizer, step, 4);
      hook.after_optimizer_step();
    }
  }
  emakit::FixedEma& ema() { return hook.ema<emakit::FixedEma>("model"); }
};

// ---- archives taken apart and put together again (archive_records.hpp) ----------------------

using emakit_test::Records;
using emakit_test::zip_bytes;
Records read_records(const std::string& zip) { return emakit_test::read_records_from_bytes(zip); }

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

}  // namespace

TEMPLATE_TEST_CASE("The hooks.md recipe (hook checkpoint and optimizer in one file) passes the checked loaders and "
                   "resumes bitwise",
                   "[checkpoint][untrusted][optimizer]", Sgd, SgdMomentum, Adam, AdamW, RMSprop, Adagrad, Lbfgs) {
  TempDir dir;
  const auto path = dir.path / "last.pt";
  Run<TestType> whole(21);
  whole.train(1, 3);
  {  // the README's lines
    torch::serialize::OutputArchive a;
    whole.hook.save_checkpoint(a);
    torch::serialize::OutputArchive o;
    whole.optimizer.save(o);
    a.write("optimizer", o);
    a.save_to(path.string());
  }
  const Weights ema_at_save = weights_of(whole.ema().averages());
  whole.train(4, 6);

  // A new process: other initial weights, then the file.
  Run<TestType> resumed(22);
  REQUIRE_NOTHROW(resumed.hook.load_checkpoint(path));
  torch::serialize::InputArchive in, optimizer_archive;
  in.load_from(path.string());
  REQUIRE(in.try_read("optimizer", optimizer_archive));
  resumed.optimizer.load(optimizer_archive);
  resumed.train(4, 6);
  CHECK(same(weights_of(*resumed.model), weights_of(*whole.model)));
  CHECK(same(weights_of(resumed.ema().averages()), weights_of(whole.ema().averages())));

  TinyNet deployed;
  REQUIRE_NOTHROW(emakit::load_weights(*deployed, path));
  CHECK(same(weights_of(*deployed), ema_at_save));
}

TEST_CASE("Modules, tensors and optimizer state nested two archives deep pass the archive check and read back",
          "[checkpoint][untrusted][optimizer]") {
  // A Sequential: Module::save writes its children under the names "0" and "2".
  auto make = [] { return torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2)); };
  torch::manual_seed(23);
  auto model = make();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 1; step <= 2; ++step) train_step(model, optimizer, step, 2);

  torch::serialize::OutputArchive top, level1, level2, module_archive, optimizer_archive;
  model->save(module_archive);
  optimizer.save(optimizer_archive);
  level2.write("module", module_archive);
  level2.write("optimizer", optimizer_archive);
  level2.write("tensor", torch::arange(6).reshape({2, 3}));
  level2.write("buffer", torch::ones({2}, torch::kFloat64), /*is_buffer=*/true);
  level1.write("level2", level2);
  level1.write("tensor", torch::full({3}, 1.5));
  top.write("level1", level1);
  top.write("tensor", torch::zeros({1}));
  const std::string bytes = archive_bytes(top);
  REQUIRE_NOTHROW(emakit::detail::scan_archive_bytes(bytes, "'nested'"));

  torch::serialize::InputArchive in, in1, in2, module_in, optimizer_in;
  in.load_from(bytes.data(), bytes.size());
  in.read("level1", in1);
  in1.read("level2", in2);
  in2.read("module", module_in);
  in2.read("optimizer", optimizer_in);
  torch::Tensor tensor;
  in2.read("tensor", tensor);
  CHECK(bitwise_equal(tensor, torch::arange(6).reshape({2, 3})));
  torch::manual_seed(24);
  auto restored = make();
  restored->load(module_in);
  CHECK(same(weights_of(*restored), weights_of(*model)));
  torch::optim::Adam restored_optimizer(restored->parameters(), torch::optim::AdamOptions(0.01));
  restored_optimizer.load(optimizer_in);
  train_step(model, optimizer, 3, 2);
  train_step(restored, restored_optimizer, 3, 2);
  CHECK(same(weights_of(*restored), weights_of(*model)));
}

TEST_CASE("Code hidden in the declaration forms of optimizer archives is refused",
          "[checkpoint][untrusted][optimizer]") {
  torch::manual_seed(25);
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  train_step(model, optimizer, 1, 4);
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  const Records good = read_records(archive_bytes(archive));
  REQUIRE_NOTHROW(emakit::detail::scan_archive_bytes(zip_bytes(good), "'good'"));

  // The code file of the parameter group, which declares attributes through __annotations__ and
  // lists the parameter "params/size".
  std::string group_code;
  std::string group_record;
  for (const auto& [name, text] : good)
    if (text.find("__annotations__[\"params/0\"] = str") != std::string::npos) group_record = name, group_code = text;
  REQUIRE_THAT(group_code,
               Contains("  __annotations__ = []\n") && Contains("  __parameters__ = [\"params/size\", ]\n"));

  auto refused = [&](const std::string& from, const std::string& to) {
    INFO(from << " -> " << to);
    const auto at = group_code.find(from);
    REQUIRE(at != std::string::npos);
    Records records = good;
    for (auto& [name, text] : records)
      if (name == group_record) text = std::string(group_code).replace(at, from.size(), to);
    REQUIRE_THROWS_WITH(emakit::detail::scan_archive_bytes(zip_bytes(records), "'hostile'"),
                        Contains("refusing 'hostile'") && Contains(group_record) && Contains("no code"));
  };
  const std::string init = "  __annotations__ = []\n";
  const std::string entry = "  __annotations__[\"params/0\"] = str\n";
  const std::string params = "  __parameters__ = [\"params/size\", ]\n";
  refused(init, "  __annotations__ = [os.system(\"x\")]\n");
  refused(init, "  __annotations__ = {}\n");
  refused(init, "__annotations__ = []\n");  // outside the class body
  refused(entry, "  __annotations__[\"params/0\"] = os.system(\"x\")\n");
  refused(entry, "  __annotations__[os.system(\"x\")] = str\n");
  refused(entry, "  __annotations__[\"params/0\"][\"x\"] = str\n");
  refused(entry, "  __annotations__[\"params/0\"] = str; import os\n");
  refused(entry, "  __annotations__[\"params/0\"] = str = torch.ones\n");
  refused(entry, "  __annotations__[\"p\\\", os.system(\\\"x\\\")] = str\n");  // an escaped quote
  refused(entry, entry + "  def __setstate__(self, state: Tuple[int]) -> None:\n    return None\n");
  refused(params, "  __parameters__ = [\"params/size\", os.system(\"x\"), ]\n");
  refused(params, "  __parameters__ = [\"params/\" + \"size\", ]\n");
  refused(params, "  __parameters__ = [\"params/size\\\", \\\"x\", ]\n");
  refused(params, "  __buffers__ = [\"\"\"x\"\"\", ]\n");

  // A class under __torch__.torch (LibTorch's custom C++ classes, whose __setstate__ is C++ code of
  // the process) is refused even when its code file only declares attributes.
  Records custom = good;
  for (auto& [name, text] : custom)
    if (name == group_record) name = "code/__torch__/torch/classes/emakit/Evil.py";
  REQUIRE_THROWS_WITH(emakit::detail::scan_archive_bytes(zip_bytes(custom), "'hostile'"),
                      Contains("refusing 'hostile'") && Contains("__torch__/torch/classes/emakit/Evil.py"));
}

}  // namespace test_optimizer_archives
