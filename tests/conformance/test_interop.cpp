// Moving a run between Python and C++ with the real packages: a state a Python peer saved is
// imported and the run continues in C++ with the peer's numbers; an emakit export is read by
// Python's torch.load (weights_only) and loaded by the peer itself (tests/conformance/_check_export.py).
// The first step after the import starts from the imported state (replay.hpp), so it also shows
// that the import carried the peer's numbers; tolerances as test_peers.cpp (kLerp, derived there).
// The Python side of docs/coming-from-python.md's recipes runs as the page shows it
// (tests/conformance/_doc_recipes.py extracts each block from the page).
#include <emakit/interop.hpp>

#include <caffe2/serialize/inline_container.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "../../examples/subprocess.hpp"
#include "replay.hpp"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <tuple>
#include <vector>

namespace test_interop {  // this file's names (unity batches: tests/CMakeLists.txt)

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
  return emakit_subprocess::run(
      {python, fmt::format("{}/_check_export.py", EMAKIT_CONFORMANCE_SCRIPTS), exported, reference.string(), peer});
}

// Runs the recipe `name` of docs/coming-from-python.md in `folder` (tests/conformance/_doc_recipes.py);
// returns its exit status.
int run_recipe(const std::string& name, const fs::path& folder) {
  const std::string python = EMAKIT_CONFORMANCE_PYTHON;
  REQUIRE(!python.empty());
  const std::string page = fmt::format("{}/../../docs/coming-from-python.md", EMAKIT_CONFORMANCE_SCRIPTS);
  return emakit_subprocess::run(
      {python, fmt::format("{}/_doc_recipes.py", EMAKIT_CONFORMANCE_SCRIPTS), page, name, folder.string()});
}

// A fresh, empty folder for a recipe's files.
fs::path recipe_folder(const char* name) {
  const fs::path folder = fs::temp_directory_path() / fmt::format("emakit_recipe_{}_{}", name, ::getpid());
  fs::remove_all(folder);
  fs::create_directories(folder);
  return folder;
}

// Whether data.pkl of a torch.save file pickles an OrderedDict at its root (what state_dict()
// returns), rather than a plain dict.
bool saved_an_ordered_dict(const fs::path& file) {
  caffe2::serialize::PyTorchStreamReader zip(file.string());
  auto [data, size] = zip.getRecord("data.pkl");
  const std::string_view pickle(static_cast<const char*>(data.get()), size);
  return pickle.substr(2, 25) == "ccollections\nOrderedDict\n";
}

// Whether data.pkl of a torch.save file pickles an OrderedDict anywhere (inside a dict).
bool pickles_an_ordered_dict(const fs::path& file) {
  caffe2::serialize::PyTorchStreamReader zip(file.string());
  auto [data, size] = zip.getRecord("data.pkl");
  const std::string_view pickle(static_cast<const char*>(data.get()), size);
  return pickle.find("collections\nOrderedDict\n") != std::string_view::npos;
}

// Both directions of a peer's recipes. `exported`: an EMA with averages to hand to Python;
// `fresh`: an EMA of the same model and options, which imports what Python saved and then holds,
// bitwise, the averages the Python peer held (reference.pt); returns it for counter checks.
template <class E>
void check_recipes(const char* peer_name, emakit::Peer peer, const E& exported, E& fresh) {
  const fs::path folder = recipe_folder(peer_name);
  emakit::export_state(exported, peer, folder / "ema.pt");
  CHECK(run_recipe(fmt::format("{}_load", peer_name), folder) == 0);

  fs::remove(folder / "ema.pt");
  REQUIRE(run_recipe(fmt::format("{}_save", peer_name), folder) == 0);
  // What the page's line saves: a state_dict(), the OrderedDict as it is (for timm, of the
  // averaged model alone: keys without module.).
  CHECK(saved_an_ordered_dict(folder / "ema.pt"));
  std::map<std::string, at::Tensor> before;  // averages() shares the EMA's tensors: copies
  for (const auto& item : fresh.averages()) before.emplace(item.key(), item.value().clone());
  const auto report = emakit::import_state(fresh, peer, folder / "ema.pt");
  CHECK(report.clean());
  const Dict reference = load_dict(folder / "reference.pt");
  std::size_t compared = 0, changed = 0;
  for (const auto& item : fresh.averages()) {
    INFO(item.key());
    const at::Tensor& held = reference.at("peer." + item.key());
    CHECK(torch::equal(item.value(), held));
    changed += torch::equal(before.at(item.key()), held) ? 0 : 1;
    ++compared;
  }
  CHECK(compared == fresh.averages().size());
  CHECK(compared == before.size());
  CHECK(changed > 0);  // the import moved the averages (15 noisy steps in Python)
  fs::remove_all(folder);
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

// docs/coming-from-python.md's Python lines, run as the page shows them, both ways. The old page
// said ema.load_state_dict(torch.load("ema.pt")), which ema-pytorch refuses (the online model's
// keys are missing); the user's torch.save(ema.state_dict()) is an OrderedDict, which LibTorch
// read as None ("isGenericDict() INTERNAL ASSERT FAILED"); timm's own layout
// (ema.module.state_dict(), keys without module.) was refused as "missing key 'average.lin.weight'".
TEST_CASE("docs/coming-from-python.md: the ema-pytorch recipes run as the page shows them, both ways",
          "[conformance][interop][docs][ema-pytorch]") {
  const auto dir = scenario_dir("ema_pytorch_peer", "defaults_with_skips");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto exported = emakit::ema_pytorch(sources);
  REQUIRE(emakit::import_state(exported, emakit::Peer::ema_pytorch, step_file(*dir, "state", 120)).clean());
  auto fresh_sources = sources_from(*dir);
  auto fresh = emakit::ema_pytorch(fresh_sources);
  check_recipes("ema_pytorch", emakit::Peer::ema_pytorch, exported, fresh);
  CHECK(fresh.step() == 15);  // the recipe's peer: 15 update calls
}

TEST_CASE("docs/coming-from-python.md: the timm ModelEmaV3 recipes run as the page shows them, both ways",
          "[conformance][interop][docs][timm]") {
  const auto dir = scenario_dir("timm_peer", "warmup_with_step");
  if (!dir) return;
  auto sources = sources_from(*dir);
  const emakit::TimmModelEmaV3Options options{
      .decay = 0.99, .min_decay = 0.1, .update_after_step = 2, .use_warmup = true, .warmup_power = 0.75};
  auto exported = emakit::timm_model_ema_v3(sources, options);
  REQUIRE(emakit::import_state(exported, emakit::Peer::timm_v3, step_file(*dir, "state", 25)).clean());
  auto fresh_sources = sources_from(*dir);
  auto fresh = emakit::timm_model_ema_v3(fresh_sources);
  check_recipes("timm_v3", emakit::Peer::timm_v3, exported, fresh);  // of ema.module
}

TEST_CASE("docs/coming-from-python.md: the AveragedModel recipes run as the page shows them, both ways",
          "[conformance][interop][docs][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "ema_no_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto exported = emakit::averaged_model_ema(sources, {.decay = 0.95, .use_buffers = false});
  REQUIRE(emakit::import_state(exported, emakit::Peer::averaged_model, step_file(*dir, "state", 12)).clean());
  auto fresh_sources = sources_from(*dir);
  auto fresh = emakit::averaged_model_ema(fresh_sources, {.decay = 0.95, .use_buffers = false});
  check_recipes("averaged_model", emakit::Peer::averaged_model, exported, fresh);
  CHECK(fresh.num_updates() == 15);
}

// state_dict()'s OrderedDict, made by the real torch.save, in the shapes Python pickles it: with
// its _metadata, items in batches of 1000 (SETITEMS) and a last batch of one (SETITEM). LibTorch's
// unpickler (1.13 and 2.x alike) failed on each with "isGenericDict() INTERNAL ASSERT FAILED ...
// please report a bug to PyTorch"; read_pickle_dict reads each as the dict it holds, the same
// entries as dict(...) of it (which LibTorch reads itself). An OrderedDict inside a dict (a
// Lightning checkpoint's current_model_state) reads as the dict it holds too; imported as an
// ema-pytorch state it is refused (no step, initted at the root) and loads nothing.
TEST_CASE("torch.save(state_dict()), an OrderedDict, reads as the dict it holds, at the root or inside a dict",
          "[conformance][interop][ema-pytorch]") {
  const auto dir = scenario_dir("ema_pytorch_peer", "defaults_with_skips");
  if (!dir) return;
  const fs::path folder = recipe_folder("ordered_dict");
  const auto file = [&](const char* name) { return (folder / name).string(); };
  const std::string code = fmt::format(
      "import sys, collections; sys.path.insert(0, '{}'); import torch, _common; from ema_pytorch import EMA\n"
      "ema = EMA(_common.Net()); ema.update()\n"
      "torch.save(ema.state_dict(), '{}'); torch.save(dict(ema.state_dict()), '{}')\n"
      "torch.save({{'ema': ema.state_dict()}}, '{}')\n"
      "one = torch.nn.Linear(2, 3, bias=False).state_dict(); torch.save(one, '{}'); torch.save(dict(one), '{}')\n"
      "many = collections.OrderedDict(('t%d' % i, torch.full((2,), float(i))) for i in range(1001))\n"
      "torch.save(many, '{}'); torch.save(dict(many), '{}')\n",
      std::string(EMAKIT_CONFORMANCE_SCRIPTS), file("ordered.pt"), file("plain.pt"), file("nested.pt"), file("one.pt"),
      file("one_plain.pt"), file("many.pt"), file("many_plain.pt"));
  REQUIRE(emakit_subprocess::run({std::string(EMAKIT_CONFORMANCE_PYTHON), "-c", code}) == 0);

  // Each OrderedDict file holds, key for key in order, bitwise what its dict(...) copy holds.
  for (const auto& [ordered, plain, entries] : std::vector<std::tuple<std::string, std::string, std::size_t>>{
           {"ordered.pt", "plain.pt", 0}, {"one.pt", "one_plain.pt", 1}, {"many.pt", "many_plain.pt", 1001}}) {
    INFO(ordered);
    REQUIRE(saved_an_ordered_dict(folder / ordered));
    const auto read = emakit::detail::read_pickle_dict(folder / ordered, "test");
    const auto expected = emakit::detail::read_pickle_dict(folder / plain, "test");
    REQUIRE(read.size() == expected.size());
    if (entries > 0) CHECK(read.size() == entries);  // 0: as many as the EMA's state_dict() holds
    CHECK(read.size() > 0);
    std::size_t compared = 0;
    auto e = expected.begin();
    for (const auto& item : read) {
      CHECK(item.key().toStringRef() == e->key().toStringRef());
      if (item.value().isTensor()) {
        CHECK(torch::equal(item.value().toTensor(), e->value().toTensor()));
      } else {
        CHECK(item.value() == e->value());
      }
      if (ordered == "many.pt") {  // what Python put there: t<i> = [i, i]
        CHECK(item.key().toStringRef() == fmt::format("t{}", compared));
        CHECK(torch::equal(item.value().toTensor(), at::full({2}, static_cast<double>(compared))));
      }
      ++compared;
      ++e;
    }
    CHECK(compared == expected.size());
  }

  auto sources = sources_from(*dir);
  auto ema = emakit::ema_pytorch(sources);
  CHECK(emakit::import_state(ema, emakit::Peer::ema_pytorch, file("ordered.pt")).clean());
  CHECK(ema.step() == 1);
  auto other_sources = sources_from(*dir);
  auto other = emakit::ema_pytorch(other_sources);
  const auto before = other.averages()["lin.weight"].clone();
  const std::string nested = file("nested.pt");
  const auto outer = emakit::detail::read_pickle_dict(nested, "test");
  REQUIRE(outer.size() == 1);
  REQUIRE(outer.at("ema").isGenericDict());
  const auto inner = outer.at("ema").toGenericDict();
  const auto root = emakit::detail::read_pickle_dict(file("ordered.pt"), "test");
  REQUIRE(inner.size() == root.size());
  std::size_t nested_compared = 0;
  auto r = root.begin();
  for (const auto& item : inner) {
    INFO(item.key().toStringRef());
    CHECK(item.key().toStringRef() == r->key().toStringRef());
    if (item.value().isTensor()) {
      CHECK(torch::equal(item.value().toTensor(), r->value().toTensor()));
      ++nested_compared;
    }
    ++r;
  }
  CHECK(nested_compared == root.size());  // ema-pytorch's state_dict(): tensors only
  CHECK_THROWS_WITH(
      emakit::import_state(other, emakit::Peer::ema_pytorch, nested),
      Catch::Matchers::StartsWith(
          fmt::format("emakit: import_state: '{}' has no 'step' and 'initted': not an ema-pytorch EMA state", nested)));
  CHECK(torch::equal(other.averages()["lin.weight"], before));
  CHECK(other.num_updates() == 0);
  fs::remove_all(folder);
}

namespace {

// _common.Net in C++ (replay.hpp): named_parameters() in Python's parameters() order, which
// diffusers' shadow_params list follows.
using DiffusersNet = CommonNet;

// A module whose one parameter, weight, is a tensor another module holds: _common.TiedNet's head
// (head.weight IS emb.weight) added to a CommonNet.
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(const at::Tensor& weight) { register_parameter("weight", weight, weight.requires_grad()); }
};
TORCH_MODULE(TiedHead);

// _diffusers_roundtrip.py's steps: N in Python, then M in emakit, then P in Python again.
constexpr std::int64_t kN = 10, kM = 8, kP = 7;
// Per update, diffusers computes s - (1 - d)(s - p) in float32 (three roundings) and emakit its
// lerp (kLerp); the two results of one update differ by at most kLerp + 1 ulps of the operands'
// magnitude. Both runs go from the same state at step N through M updates whose results may
// differ by that, then P updates by EMAModel on both sides, from states that differ: an update
// shrinks a difference by d <= 1 and its own roundings (on different inputs) add at most 1 ulp.
// So after M + P updates the runs differ by at most (kLerp + 1) * (M + P) ulps at the largest
// magnitude the tensor had over the run.
constexpr double kRoundTrip = (kLerp + 1) * static_cast<double>(kM + kP);

int diffusers_script(const char* mode, const char* scenario, const fs::path& folder) {
  const std::string python = EMAKIT_CONFORMANCE_PYTHON;
  REQUIRE(!python.empty());
  return emakit_subprocess::run(
      {python, fmt::format("{}/_diffusers_roundtrip.py", EMAKIT_CONFORMANCE_SCRIPTS), mode, scenario, folder.string()});
}

// A diffusers EMAModel saves after N steps; emakit imports it, goes on M steps and exports; the
// real EMAModel.load_state_dict loads that and goes on P steps: every parameter within kRoundTrip
// ulps of the run that never left Python, optimization_step equal. `make(net)` makes the EMA.
template <class Make>
void diffusers_round_trip(const char* scenario, bool frozen_embedding, bool tied_head, Make make) {
  if (!have_python()) EMAKIT_SKIP("no Python (EMAKIT_PYTHON is empty): the diffusers round trip runs diffusers");
  const fs::path folder = recipe_folder(fmt::format("diffusers_{}", scenario).c_str());
  REQUIRE(diffusers_script("save", scenario, folder) == 0);
  const Dict trajectory = load_dict(folder / "trajectory.pt");
  const auto at_step = [&](std::int64_t step) { return fmt::format("s{}.", step); };

  DiffusersNet net;
  if (frozen_embedding) net->emb->weight.set_requires_grad(false);          // as the script's model
  if (tied_head) net->register_module("head", TiedHead(net->emb->weight));  // _common.TiedNet
  load_into(*net, trajectory, at_step(kN));
  auto ema = make(*net);

  // The EMA holds the parameters in Python's parameters() order (order.<name> = position); a tied
  // name (head.weight IS emb.weight), which parameters() does not list, holds its target's tensor.
  std::int64_t position = 0, tied = 0;
  std::map<std::string, std::int64_t> at_position;  // each name -> its position in shadow_params
  for (const auto& item : ema.averages()) {
    INFO(item.key());
    if (trajectory.count("order." + item.key()) == 0) {
      REQUIRE(tied_head);
      CHECK(item.key() == "head.weight");
      CHECK(item.value().data_ptr() == ema.averages()["emb.weight"].data_ptr());
      at_position[item.key()] = trajectory.at("order.emb.weight").template item<std::int64_t>();
      ++tied;
      continue;
    }
    CHECK(trajectory.at("order." + item.key()).template item<std::int64_t>() == position);
    at_position[item.key()] = position;
    ++position;
  }
  CHECK(tied == (tied_head ? 1 : 0));
  std::int64_t parameters = 0;
  for (const auto& [key, _] : trajectory) parameters += key.rfind("order.", 0) == 0 ? 1 : 0;
  REQUIRE(position == parameters);
  REQUIRE(parameters == 7);  // lin, conv, bn: weight and bias; emb.weight

  // The import is a copy of shadow_params, position i to the i-th parameter (and a tied name).
  CHECK(emakit::import_state(ema, emakit::Peer::diffusers, folder / "state.pt").clean());
  CHECK(ema.step() == kN);
  const auto saved = emakit::detail::read_pickle_dict(folder / "state.pt", "test");
  const auto shadow = saved.at("shadow_params").toListRef();
  REQUIRE(static_cast<std::int64_t>(shadow.size()) == parameters);
  std::size_t copied = 0;
  for (const auto& item : ema.averages()) {
    INFO(item.key());
    CHECK(torch::equal(item.value(), shadow[static_cast<std::size_t>(at_position.at(item.key()))].toTensor()));
    ++copied;
  }
  CHECK(static_cast<std::int64_t>(copied) == parameters + tied);
  if (tied_head) CHECK(ema.averages()["head.weight"].data_ptr() == ema.averages()["emb.weight"].data_ptr());

  for (std::int64_t step = kN + 1; step <= kN + kM; ++step) {
    load_into(*net, trajectory, at_step(step));
    ema.update();
  }
  CHECK(ema.step() == kN + kM);
  emakit::export_state(ema, emakit::Peer::diffusers, folder / "export.pt");
  REQUIRE(diffusers_script("load", scenario, folder) == 0);

  const Dict reference = load_dict(folder / "reference.pt");
  const Dict continued = load_dict(folder / "continued.pt");
  CHECK(continued.at("optimization_step").item<std::int64_t>() == kN + kM + kP);
  CHECK(reference.at("optimization_step").item<std::int64_t>() == kN + kM + kP);
  std::int64_t compared = 0;
  double worst = 0;
  for (const auto& [key, expected] : reference) {
    if (key.rfind("peer.", 0) != 0) continue;
    INFO(key);
    const std::string name = key.substr(5);
    at::Tensor magnitude = emakit_test::operand_magnitude(expected, continued.at(key));
    for (std::int64_t step = kN; step <= kN + kM + kP; ++step)
      magnitude = torch::maximum(magnitude, trajectory.at(at_step(step) + name).to(at::kDouble).abs());
    const double ulps = ulp_distance(continued.at(key), expected, magnitude);
    CHECK(ulps <= kRoundTrip);
    worst = std::max(worst, ulps);
    // An averaged parameter is no copy of the model's last state (a frozen one is, on both sides).
    const bool is_frozen = frozen_embedding && name == "emb.weight";
    CHECK(torch::equal(expected, trajectory.at(at_step(kN + kM + kP) + name)) == is_frozen);
    ++compared;
  }
  CHECK(compared == parameters);
  std::size_t entries = 0;
  for (const auto& [key, _] : continued) entries += key.rfind("peer.", 0) == 0 ? 1 : 0;
  CHECK(entries == static_cast<std::size_t>(parameters));
  std::cout << "diffusers round trip (" << scenario << "): " << compared << " parameters compared, max " << worst
            << " ulps (bound " << kRoundTrip << ")" << std::endl;
  fs::remove_all(folder);
}

}  // namespace

TEST_CASE("diffusers EMAModel: saved in Python, continued in C++, loaded back by EMAModel, equals a Python-only run",
          "[conformance][interop][diffusers]") {
  diffusers_round_trip("ramp", /*frozen_embedding=*/true, /*tied_head=*/false, [](torch::nn::Module& net) {
    return emakit::diffusers_ema_model(net, {.decay = 0.99, .min_decay = 0.05, .update_after_step = 3});
  });
}

TEST_CASE("diffusers EMAModel with use_ema_warmup: saved in Python, continued in C++, loaded back by EMAModel",
          "[conformance][interop][diffusers]") {
  diffusers_round_trip("warmup", /*frozen_embedding=*/false, /*tied_head=*/false, [](torch::nn::Module& net) {
    return emakit::diffusers_ema_model_warmup(net, {.decay = 0.995,
                                                    .min_decay = 0.0,
                                                    .update_after_step = 2,
                                                    .use_ema_warmup = true,
                                                    .inv_gamma = 1.5,
                                                    .power = 0.75});
  });
}

TEST_CASE("diffusers EMAModel with a tied weight: shadow_params hold it once, both ways, loaded back by EMAModel",
          "[conformance][interop][diffusers][ties]") {
  diffusers_round_trip("tied", /*frozen_embedding=*/false, /*tied_head=*/true, [](torch::nn::Module& net) {
    return emakit::diffusers_ema_model(net, {.decay = 0.99, .min_decay = 0.05, .update_after_step = 3});
  });
}

// luxonis_peer.py's callback_state: an EMACallback's ModelEma driven 30 steps; state_0015.pt is
// torch.save(callback.state_dict()) after step 15 ({"ema_state_dict": dict, "updates": int}),
// state_0030.pt the same after step 30. Recorded in the seed venv (the fixture replays in CI).
TEST_CASE("luxonis-train EMACallback: a state saved in Python continues in C++, the export is the callback's own file",
          "[conformance][interop][luxonis]") {
  const auto dir = scenario_dir("luxonis_peer", "callback_state");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::luxonis_model_ema(sources, {.decay = 0.99, .decay_tau = 5.0});
  CHECK(emakit::import_state(ema, emakit::Peer::luxonis_callback, step_file(*dir, "state", 15)).clean());
  CHECK(ema.num_updates() == load_dict(step_file(*dir, "step", 15)).at("counter.updates").item<std::int64_t>());
  CHECK(ema.num_updates() == 15);
  const auto luxonis_counters = [](const auto& e, const Dict& rec) {
    CHECK(e.num_updates() == rec.at("counter.updates").template item<std::int64_t>());
  };
  require_counts(replay(*dir, sources, ema, false, luxonis_counters, kLerp, false, 16), *dir, 16);

  // The export holds what the callback's own file holds at step 30: the same two entries, updates
  // a Python int of the same value, the same names in ema_state_dict with the same dtypes and
  // shapes; integer tensors bitwise, floating ones within one update's bound (the replay's last
  // update started from the peer's state of step 29).
  const auto path = temp_path("luxonis_export");
  emakit::export_state(ema, emakit::Peer::luxonis_callback, path);
  const auto ours = emakit::detail::read_pickle_dict(path, "test");
  const auto theirs = emakit::detail::read_pickle_dict(step_file(*dir, "state", 30), "test");
  REQUIRE(ours.size() == 2);
  REQUIRE(theirs.size() == 2);
  REQUIRE(theirs.at("updates").isInt());
  CHECK(ours.at("updates").isInt());
  CHECK(ours.at("updates").toInt() == theirs.at("updates").toInt());
  CHECK(ours.at("updates").toInt() == 30);
  const auto our_tensors = ours.at("ema_state_dict").toGenericDict();
  const auto their_tensors = theirs.at("ema_state_dict").toGenericDict();
  CHECK(our_tensors.size() == their_tensors.size());
  const Dict before = load_dict(step_file(*dir, "step", 29));
  const Dict last = load_dict(step_file(*dir, "step", 30));
  std::size_t compared = 0;
  for (const auto& item : their_tensors) {
    const std::string name = item.key().toStringRef();
    INFO(name);
    const at::Tensor& expected = item.value().toTensor();
    REQUIRE(our_tensors.contains(name));
    const at::Tensor got = our_tensors.at(name).toTensor();
    CHECK(got.scalar_type() == expected.scalar_type());
    REQUIRE(got.sizes() == expected.sizes());
    CHECK(torch::equal(expected, last.at("peer." + name)));  // the file is the peer's state at step 30
    if (!expected.is_floating_point()) {
      CHECK(torch::equal(got, expected));
    } else {
      const at::Tensor magnitude = torch::maximum(emakit_test::operand_magnitude(before.at("peer." + name), expected),
                                                  last.at("source." + name).to(at::kDouble).abs());
      CHECK(ulp_distance(got, expected, magnitude) <= kLerp);
    }
    ++compared;
  }
  CHECK(compared == static_cast<std::size_t>(model_tensors(*dir)));
  fs::remove(path);
}

// lightning_peer.py's every3_from4 (EMAWeightAveraging(decay=0.9, update_every_n_steps=3,
// update_starting_at_step=4, use_buffers=False), 16 optimizer steps, updates at 7, 10, 13, 16)
// keeps the real checkpoints trainer.save_checkpoint wrote: epoch0.ckpt at global_step 8 and
// last.ckpt at 16, each with Lightning's own entries (loops, optimizer_states, and
// current_model_state: an OrderedDict inside the dict). Recorded in the seed venv.
TEST_CASE("lightning EMAWeightAveraging: a real checkpoint imports, continues in C++, and exports its entries",
          "[conformance][interop][lightning]") {
  const auto dir = scenario_dir("lightning_peer", "every3_from4");
  if (!dir) return;
  const emakit::LightningEmaWeightAveragingOptions options{
      .decay = 0.9, .use_buffers = false, .update_every_n_steps = 3, .update_starting_at_step = 4};
  // test_lightning_lightly.cpp's bound for the callback's avg_fn against emakit's update, at d = 0.9.
  const double avg_fn_ulps = 2.0 + 7.0 * (1.0 - options.decay);
  const fs::path last_ckpt = *dir / "last.ckpt";

  // The last checkpoint: its state_dict is the average the callback held at step 16, bitwise.
  {
    auto sources = sources_from(*dir);
    auto ema = emakit::lightning_ema_weight_averaging(sources, options);
    CHECK(emakit::import_state(ema, emakit::Peer::lightning, last_ckpt).clean());
    CHECK(ema.step() == 16);
    CHECK(ema.num_updates() == 4);
    CHECK(ema.last_update_step() == 16);
    const Dict recorded = load_dict(*dir / "checkpoint.pt");
    const Dict step16 = load_dict(step_file(*dir, "step", 16));
    CHECK(recorded.at("averaging_state.n_averaged").item<std::int64_t>() == 4);
    std::size_t compared = 0;
    for (const auto& item : ema.averages()) {
      INFO(item.key());
      CHECK(torch::equal(item.value(), recorded.at("state_dict." + item.key())));
      CHECK(torch::equal(item.value(), step16.at("peer." + item.key())));
      ++compared;
    }
    CHECK(compared == static_cast<std::size_t>(model_tensors(*dir)));

    // Other options than the callback's: its n_averaged is not what they make in 16 steps.
    auto other_sources = sources_from(*dir);
    auto other = emakit::lightning_ema_weight_averaging(other_sources, {.decay = 0.9, .use_buffers = false});
    CHECK_THROWS_WITH(emakit::import_state(other, emakit::Peer::lightning, last_ckpt),
                      Catch::Matchers::Contains("n_averaged is 4 in the file, but this EMA's schedule makes 16 updates "
                                                "in global_step 16 steps"));
    CHECK(other.num_updates() == 0);
  }

  // epoch0.ckpt (global_step 8, one update: the copy at 7), then steps 9..16 replayed in C++.
  auto sources = sources_from(*dir);
  auto ema = emakit::lightning_ema_weight_averaging(sources, options);
  CHECK(emakit::import_state(ema, emakit::Peer::lightning, *dir / "epoch0.ckpt").clean());
  CHECK(ema.step() == 8);
  CHECK(ema.num_updates() == 1);
  CHECK(ema.last_update_step() == 7);
  const Dict step8 = load_dict(step_file(*dir, "step", 8));
  std::size_t imported = 0;
  for (const auto& item : ema.averages()) {
    INFO(item.key());
    CHECK(torch::equal(item.value(), step8.at("peer." + item.key())));
    ++imported;
  }
  CHECK(imported == static_cast<std::size_t>(model_tensors(*dir)));
  const auto lightning_counters = [](const auto& e, const Dict& rec) {
    CHECK(e.num_updates() == rec.at("counter.n_averaged").template item<std::int64_t>());
    CHECK(e.step() == rec.at("counter.global_step").template item<std::int64_t>());
    CHECK(e.last_update_step() == rec.at("counter.latest_update_step").template item<std::int64_t>());
  };
  require_counts(replay(*dir, sources, ema, false, lightning_counters, avg_fn_ulps, false, 9), *dir, 9);

  // The export holds the entries of last.ckpt the callback's on_load_checkpoint reads: the same
  // types, keys, dtypes and shapes; integer tensors bitwise, floating ones within one update's
  // bound (the replay's last update started from the peer's state of step 15).
  const auto path = temp_path("lightning_export");
  emakit::export_state(ema, emakit::Peer::lightning, path);
  const auto ours = emakit::detail::read_pickle_dict(path, "test");
  const auto theirs = emakit::detail::read_pickle_dict(last_ckpt, "test");
  REQUIRE(ours.size() == 4);
  for (const char* key : {"state_dict", "averaging_state", "callbacks", "global_step"}) {
    INFO(key);
    REQUIRE(theirs.contains(key));
    REQUIRE(ours.contains(key));
    CHECK(ours.at(key).tagKind() == theirs.at(key).tagKind());
  }
  CHECK(theirs.contains("current_model_state"));  // what the export leaves to the run's own checkpoint
  CHECK(theirs.contains("optimizer_states"));
  CHECK(ours.at("global_step").toInt() == theirs.at("global_step").toInt());
  CHECK(ours.at("global_step").toInt() == 16);
  const auto callback = [](const c10::impl::GenericDict& d) {
    const auto c = d.at("callbacks").toGenericDict();
    REQUIRE(c.contains("EMAWeightAveraging"));
    const auto fields = c.at("EMAWeightAveraging").toGenericDict();
    REQUIRE(fields.size() == 1);
    REQUIRE(fields.at("latest_update_step").isInt());
    return fields.at("latest_update_step").toInt();
  };
  CHECK(callback(ours) == callback(theirs));
  CHECK(callback(ours) == 16);
  const auto our_avg = ours.at("averaging_state").toGenericDict();
  const auto their_avg = theirs.at("averaging_state").toGenericDict();
  REQUIRE(our_avg.size() == 1);
  REQUIRE(their_avg.size() == 1);
  const at::Tensor n_ours = our_avg.at("n_averaged").toTensor(), n_theirs = their_avg.at("n_averaged").toTensor();
  CHECK(n_ours.scalar_type() == n_theirs.scalar_type());
  CHECK(n_ours.sizes() == n_theirs.sizes());
  CHECK(torch::equal(n_ours, n_theirs));
  CHECK(n_ours.item<std::int64_t>() == 4);

  const auto our_tensors = ours.at("state_dict").toGenericDict();
  const auto their_tensors = theirs.at("state_dict").toGenericDict();
  CHECK(our_tensors.size() == their_tensors.size());
  const Dict before = load_dict(step_file(*dir, "step", 15));
  const Dict last = load_dict(step_file(*dir, "step", 16));
  std::size_t compared = 0, floating = 0;
  for (const auto& item : their_tensors) {
    const std::string name = item.key().toStringRef();
    INFO(name);
    const at::Tensor& expected = item.value().toTensor();
    REQUIRE(our_tensors.contains(name));
    const at::Tensor got = our_tensors.at(name).toTensor();
    CHECK(got.scalar_type() == expected.scalar_type());
    REQUIRE(got.sizes() == expected.sizes());
    CHECK(torch::equal(expected, last.at("peer." + name)));  // the checkpoint is the peer's state at step 16
    if (!expected.is_floating_point()) {
      CHECK(torch::equal(got, expected));
    } else {
      const at::Tensor magnitude = torch::maximum(emakit_test::operand_magnitude(before.at("peer." + name), expected),
                                                  last.at("source." + name).to(at::kDouble).abs());
      CHECK(ulp_distance(got, expected, magnitude) <= avg_fn_ulps);
      ++floating;
    }
    ++compared;
  }
  CHECK(compared == static_cast<std::size_t>(model_tensors(*dir)));
  CHECK(floating > 0);

  // The export imports back: the same averages, bitwise, and counters.
  auto back_sources = sources_from(*dir);
  auto back = emakit::lightning_ema_weight_averaging(back_sources, options);
  CHECK(emakit::import_state(back, emakit::Peer::lightning, path).clean());
  CHECK(back.step() == 16);
  CHECK(back.num_updates() == 4);
  CHECK(back.last_update_step() == 16);
  std::size_t round_trip = 0;
  for (const auto& item : back.averages()) {
    CHECK(torch::equal(item.value(), ema.averages()[item.key()]));
    ++round_trip;
  }
  CHECK(round_trip == compared);
  fs::remove(path);
}

// ---- The seed peers' round trips -------------------------------------------------------------
//
// luxonis-train's EMACallback, Lightning's EMAWeightAveraging and nvalchemi's EMAHook live in the
// seed venv, which CI does not install. Their round trip: the peer's own file imported after step
// N, steps N+1..F in emakit alone, the export loaded by the real peer the way its users load a
// file (tests/conformance/_peer_roundtrip.py), which goes on F+1..L on the recorded model: equal to
// the peer's own run at L within the bound, counters equal. It runs live when the environment has
// EMAKIT_SEED_PYTHON (the seed venv's Python: scripts/test.sh exports it in a seed-packages run,
// EMAKIT_SEED_PACKAGES=1), and from
// its recording otherwise: tests/conformance/fixtures/roundtrip/<peer>.export.pt is the file
// emakit exported when it was recorded, which the real peer loaded and continued into
// <peer>.continued.pt. Without the venv this run's export must be that file, entry by entry (keys,
// Python types, values; tensors bitwise), so the recorded continuation is the continuation of
// this export; an export that changed fails here, asking to re-record
// (./scripts/seed_fixtures.sh roundtrip).
namespace {

fs::path recorded_round_trips() { return fs::path(EMAKIT_CONFORMANCE_SCRIPTS) / "fixtures" / "roundtrip"; }

// CHECKs that `ours` is `recorded`, entry by entry; returns how many leaves it compared.
std::size_t same_entries(const c10::IValue& ours, const c10::IValue& recorded, const std::string& where) {
  INFO(where);
  REQUIRE(std::string(ours.tagKind()) == recorded.tagKind());
  if (recorded.isGenericDict()) {
    const auto a = ours.toGenericDict(), b = recorded.toGenericDict();
    CHECK(a.size() == b.size());
    std::size_t leaves = 0;
    for (const auto& item : b) {
      const std::string key = item.key().toStringRef();
      REQUIRE(a.contains(key));
      leaves += same_entries(a.at(key), item.value(), where + "." + key);
    }
    return leaves;
  }
  if (recorded.isTensor()) {
    CHECK(emakit_test::bitwise_equal(ours.toTensor(), recorded.toTensor()));
  } else if (recorded.isInt()) {
    CHECK(ours.toInt() == recorded.toInt());
  } else if (recorded.isDouble()) {
    CHECK(ours.toDouble() == recorded.toDouble());
  } else if (recorded.isBool()) {
    CHECK(ours.toBool() == recorded.toBool());
  } else {
    FAIL("the recorded export holds a " << recorded.tagKind() << ", which emakit never writes");
  }
  return 1;
}

// The recording's package versions (fixtures/roundtrip/versions.txt) are pins of
// scripts/requirements-seed.txt, as a seed fixture's.
void check_recorded_versions() {
  const fs::path root = fs::path(EMAKIT_CONFORMANCE_SCRIPTS) / ".." / "..";
  std::set<std::string> pins;
  std::ifstream requirements(root / "scripts" / "requirements-seed.txt");
  REQUIRE(requirements.good());
  for (std::string line; std::getline(requirements, line);) pins.insert(line);
  std::ifstream versions(recorded_round_trips() / "versions.txt");
  REQUIRE(versions.good());
  int packages = 0;
  for (std::string line; std::getline(versions, line);) {
    if (line.find("==") == std::string::npos) continue;
    INFO("the round trips were recorded with " << line << ": re-record with ./scripts/seed_fixtures.sh roundtrip");
    CHECK(pins.count(line) == 1);
    ++packages;
  }
  CHECK(packages >= 2);  // torch and the peers' packages
}

// Runs tests/conformance/_peer_roundtrip.py with `python`: the real `peer` loads `exported`
// (emakit's export after step `from`) and goes on to the scenario's last step, writing `out`.
int run_round_trip(const std::string& python, const std::string& peer, const fs::path& dir, const fs::path& exported,
                   std::int64_t from, const fs::path& out) {
  return emakit_subprocess::run({python, fmt::format("{}/_peer_roundtrip.py", EMAKIT_CONFORMANCE_SCRIPTS), peer,
                                 dir.string(), exported.string(), std::to_string(from), out.string()});
}

// What the real seed `peer` holds at the scenario's last step after it loaded `exported`
// (emakit's export after step `from`): run now with the seed venv, else the recording, after
// checking that `exported` is the recorded export (`tensors`: how many tensors it holds).
Dict continued_by_peer(const std::string& peer, const fs::path& dir, const fs::path& exported, std::int64_t from,
                       std::size_t tensors) {
  const char* seed = std::getenv("EMAKIT_SEED_PYTHON");
  if (seed != nullptr && *seed != '\0') {
    const fs::path out = exported.parent_path() / (peer + ".continued.pt");
    REQUIRE(run_round_trip(seed, peer, dir, exported, from, out) == 0);
    if (const char* record = std::getenv("EMAKIT_RECORD_ROUNDTRIP"); record != nullptr && *record != '\0') {
      fs::create_directories(record);
      fs::copy_file(exported, fs::path(record) / (peer + ".export.pt"), fs::copy_options::overwrite_existing);
      fs::copy_file(out, fs::path(record) / (peer + ".continued.pt"), fs::copy_options::overwrite_existing);
    }
    std::cout << peer << " round trip: the real package loaded emakit's export (live, " << seed << ")" << std::endl;
    return load_dict(out);
  }
  check_recorded_versions();
  const fs::path recorded = recorded_round_trips() / (peer + ".export.pt");
  INFO("no EMAKIT_SEED_PYTHON: the recorded round trip "
       << recorded
       << " (if emakit's export changed on purpose, re-record it with "
          "./scripts/seed_fixtures.sh roundtrip)");
  REQUIRE(fs::exists(recorded));
  const auto ours = emakit::detail::read_pickle_dict(exported, "test");
  const auto theirs = emakit::detail::read_pickle_dict(recorded, "test");
  std::size_t tensor_leaves = 0;
  const std::function<void(const c10::IValue&)> count = [&](const c10::IValue& v) {
    if (v.isTensor()) ++tensor_leaves;
    if (v.isGenericDict())
      for (const auto& item : v.toGenericDict()) count(item.value());
  };
  count(c10::IValue(theirs));
  REQUIRE(tensor_leaves == tensors);
  const std::size_t leaves = same_entries(c10::IValue(ours), c10::IValue(theirs), "export");
  CHECK(leaves >= tensors);
  std::cout << peer << " round trip: emakit's export is the recorded one (" << leaves
            << " entries, tensors bitwise), which the real package loaded" << std::endl;
  return load_dict(recorded_round_trips() / (peer + ".continued.pt"));
}

// Sets the sources to the recorded model of steps from..to (inclusive) and updates `ema` after
// each, vetoed where the peer's trainer vetoed: emakit alone, never reset to the peer's state.
// `pass_step`: give update() the step, as timm's caller does.
template <class E>
void drive(const fs::path& dir, std::vector<emakit::SourceTensor>& sources, E& ema, std::int64_t from, std::int64_t to,
           bool pass_step = false) {
  for (std::int64_t step = from; step <= to; ++step) {
    const Dict rec = load_dict(step_file(dir, "step", step));
    {
      torch::NoGradGuard no_grad;
      for (auto& s : sources) s.tensor.copy_(rec.at("source." + s.name));
    }
    const auto vetoed = rec.find("vetoed");
    emakit::StepInfo info{.vetoed = rec.at("called").item<std::int64_t>() == 0 ||
                                    (vetoed != rec.end() && vetoed->second.item<std::int64_t>() != 0)};
    if (pass_step) info.step = step;
    ema.update(info);
  }
}

// The peer's continuation against its own run at the last step L: every model tensor (integers
// bitwise), every counter equal. Both runs start from one state after step N; the steps N+1..L
// update it by at most `per_update` + 1 ulps apart each (the diffusers round trip's derivation:
// emakit's update against the peer's, then the peer's on states that differ by what came before,
// an update shrinking a difference by d <= 1): (per_update + 1) (L - N) ulps at the largest
// magnitude the tensor had over those steps.
// `integers`: for an integer tensor, what the continuation holds instead of the peer's own run
// (a peer whose integer arithmetic differs from emakit's copy).
void check_continued(const Dict& continued, const fs::path& dir, std::int64_t n, double per_update, const char* peer,
                     const Dict& integers = {}) {
  const std::int64_t last = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  const Dict reference = load_dict(step_file(dir, "step", last));
  const double bound = (per_update + 1) * static_cast<double>(last - n);
  REQUIRE(continued.count("loaded_from_export") == 1);
  CHECK(continued.at("loaded_from_export").item<std::int64_t>() == 1);
  std::int64_t compared = 0, counters = 0;
  double worst = 0;
  for (const auto& [key, expected] : reference) {
    INFO(key);
    if (key.rfind("counter.", 0) == 0) {
      REQUIRE(continued.count(key) == 1);
      CHECK(torch::equal(continued.at(key), expected));
      ++counters;
      continue;
    }
    if (key.rfind("peer.", 0) != 0) continue;
    REQUIRE(continued.count(key) == 1);
    const at::Tensor& got = continued.at(key);
    if (!expected.is_floating_point()) {
      const auto instead = integers.find(key);
      CHECK(emakit_test::bitwise_equal(got, instead == integers.end() ? expected : instead->second));
    } else {
      const std::string name = key.substr(5);
      at::Tensor magnitude = emakit_test::operand_magnitude(expected, got);
      for (std::int64_t step = n; step <= last; ++step) {
        const Dict rec = load_dict(step_file(dir, "step", step));
        magnitude = torch::maximum(magnitude, rec.at("source." + name).to(at::kDouble).abs());
        if (const auto p = rec.find(key); p != rec.end())
          magnitude = torch::maximum(magnitude, p->second.to(at::kDouble).abs());
      }
      const double ulps = ulp_distance(got, expected, magnitude);
      CHECK(ulps <= bound);
      worst = std::max(worst, ulps);
    }
    ++compared;
  }
  CHECK(compared == model_tensors(dir));
  CHECK(counters > 0);
  std::cout << peer << " round trip: " << compared << " tensors and " << counters
            << " counters compared with the peer's own run at step " << last << ", max " << worst << " ulps (bound "
            << bound << ")" << std::endl;
}

}  // namespace

// luxonis_peer.py's callback_state: the callback's file after step 15, emakit 16..22, the callback
// loads the export and goes on 23..30.
TEST_CASE("luxonis-train EMACallback round trip: saved in Python, continued in C++, loaded back by the callback",
          "[conformance][interop][luxonis][seed-roundtrip]") {
  const auto dir = scenario_dir("luxonis_peer", "callback_state");
  if (!dir) return;
  constexpr std::int64_t kSaved = 15, kExported = 22;
  auto sources = sources_from(*dir);
  auto ema = emakit::luxonis_model_ema(sources, {.decay = 0.99, .decay_tau = 5.0});
  REQUIRE(emakit::import_state(ema, emakit::Peer::luxonis_callback, step_file(*dir, "state", kSaved)).clean());
  drive(*dir, sources, ema, kSaved + 1, kExported);
  CHECK(ema.num_updates() == kExported);
  const fs::path folder = recipe_folder("luxonis_round_trip");
  emakit::export_state(ema, emakit::Peer::luxonis_callback, folder / "export.pt");
  const Dict continued = continued_by_peer("luxonis_callback", *dir, folder / "export.pt", kExported,
                                           static_cast<std::size_t>(model_tensors(*dir)));
  check_continued(continued, *dir, kSaved, kLerp, "luxonis_callback");
  fs::remove_all(folder);
}

// nvalchemi_peer.py's resume: torch.save(hook.state_dict()) after batch 8 (ctx.step_count 7:
// batch 2 was vetoed), emakit drives batches 9..14 (batch 10 vetoed), the hook loads the export and
// drives 15..20.
TEST_CASE("nvalchemi EMAHook round trip: the hook's own file imports with the trainer's step, loaded back by EMAHook",
          "[conformance][interop][nvalchemi][seed-roundtrip]") {
  const auto dir = scenario_dir("nvalchemi_peer", "resume");
  if (!dir) return;
  constexpr std::int64_t kSaved = 8, kExported = 14;
  const emakit::NvalchemiEmaOptions options{.decay = 0.85, .update_every = 3, .start_step = 4, .use_buffers = false};
  const Dict at_save = load_dict(step_file(*dir, "step", kSaved));
  const std::int64_t step_count = at_save.at("counter.step_count").item<std::int64_t>();
  REQUIRE(step_count == 7);
  auto sources = sources_from(*dir);
  auto ema = emakit::nvalchemi_ema(sources, options);
  const fs::path file = step_file(*dir, "state", kSaved);
  // The hook's dict (pydantic's model_dump, a plain dict) holds its AveragedModel's state_dict(),
  // an OrderedDict.
  CHECK_FALSE(saved_an_ordered_dict(file));
  CHECK(pickles_an_ordered_dict(file));
  CHECK_THROWS_WITH(emakit::import_state(ema, emakit::Peer::nvalchemi_hook, file),
                    Catch::Matchers::Contains("an nvalchemi EMAHook state holds no step"));
  CHECK(ema.num_updates() == 0);
  REQUIRE(emakit::import_state(ema, emakit::Peer::nvalchemi_hook, file, {.step = step_count}).clean());
  CHECK(ema.step() == step_count);
  CHECK(ema.num_updates() == at_save.at("counter.num_updates").item<std::int64_t>());
  CHECK(ema.num_updates() == 1);  // completed step 6
  CHECK(ema.last_update_step() == 6);
  // Bitwise the hook's average as the file holds it (the generator's hook, reloaded at batch 8,
  // records no peer.* until it remakes its averaged model).
  const auto saved = emakit::detail::read_pickle_dict(file, "test");
  const auto averaged_model = saved.at("averaged_model_state").toGenericDict();
  CHECK(saved.at("model_key").toStringRef() == "main");
  std::size_t imported = 0;
  for (const auto& item : ema.averages()) {
    INFO(item.key());
    CHECK(emakit_test::bitwise_equal(item.value(), averaged_model.at("module." + item.key()).toTensor()));
    ++imported;
  }
  CHECK(imported == static_cast<std::size_t>(model_tensors(*dir)));
  CHECK(averaged_model.size() == imported + 1);  // and n_averaged

  drive(*dir, sources, ema, kSaved + 1, kExported);
  const Dict at_export = load_dict(step_file(*dir, "step", kExported));
  CHECK(ema.step() == at_export.at("counter.step_count").item<std::int64_t>());
  CHECK(ema.num_updates() == at_export.at("counter.num_updates").item<std::int64_t>());
  const fs::path folder = recipe_folder("nvalchemi_round_trip");
  emakit::export_state(ema, emakit::Peer::nvalchemi_hook, folder / "export.pt");
  const Dict continued = continued_by_peer("nvalchemi_hook", *dir, folder / "export.pt", kExported,
                                           static_cast<std::size_t>(model_tensors(*dir)) + 1);  // + n_averaged
  check_continued(continued, *dir, kSaved, kLerp, "nvalchemi_hook");
  fs::remove_all(folder);
}

// lightning_peer.py's roundtrip (EMAWeightAveraging(decay=0.9, update_every_n_steps=2,
// update_starting_at_step=3, use_buffers=True), 3 epochs of 7 steps): epoch0.ckpt (global_step 7)
// imported, emakit 8..14, the export merged into the run's epoch1.ckpt and Trainer.fit resumed
// from it to 21.
TEST_CASE(
    "Lightning EMAWeightAveraging round trip: a real checkpoint imported, continued in C++, resumed by Trainer.fit",
    "[conformance][interop][lightning][seed-roundtrip]") {
  const auto dir = scenario_dir("lightning_peer", "roundtrip");
  if (!dir) return;
  constexpr std::int64_t kSaved = 7, kExported = 14;
  const emakit::LightningEmaWeightAveragingOptions options{
      .decay = 0.9, .use_buffers = true, .update_every_n_steps = 2, .update_starting_at_step = 3};
  auto sources = sources_from(*dir);
  auto ema = emakit::lightning_ema_weight_averaging(sources, options);
  REQUIRE(emakit::import_state(ema, emakit::Peer::lightning, *dir / "epoch0.ckpt").clean());
  const Dict at_save = load_dict(step_file(*dir, "step", kSaved));
  CHECK(ema.step() == kSaved);
  CHECK(ema.num_updates() == at_save.at("counter.n_averaged").item<std::int64_t>());
  CHECK(ema.last_update_step() == at_save.at("counter.latest_update_step").item<std::int64_t>());
  drive(*dir, sources, ema, kSaved + 1, kExported);
  const Dict at_export = load_dict(step_file(*dir, "step", kExported));
  CHECK(ema.num_updates() == at_export.at("counter.n_averaged").item<std::int64_t>());
  CHECK(ema.last_update_step() == at_export.at("counter.latest_update_step").item<std::int64_t>());
  const fs::path folder = recipe_folder("lightning_round_trip");
  emakit::export_state(ema, emakit::Peer::lightning, folder / "export.ckpt");
  const Dict continued = continued_by_peer("lightning", *dir, folder / "export.ckpt", kExported,
                                           static_cast<std::size_t>(model_tensors(*dir)) + 1);  // + n_averaged

  // Lightning averages an integer buffer in float and truncates it into the long tensor, where
  // emakit copies integers (test_lightning_lightly.cpp): the continuation starts from emakit's
  // num_batches_tracked (the model's count at step 14), so at 21 it holds Lightning's update
  // applied from there at each update after 14 (decay * v + (1 - decay) * m in float32, then
  // truncated; ATen's own ops here), not the Python-only run's value.
  const std::int64_t last = load_dict(*dir / "meta.pt").at("steps").item<std::int64_t>();
  Dict integers;
  std::int64_t later_updates = 0;
  for (const auto& item : ema.averages()) {
    if (item.value().is_floating_point()) continue;
    at::Tensor v = item.value().clone();
    std::int64_t averaged = at_export.at("counter.n_averaged").item<std::int64_t>();
    later_updates = 0;
    for (std::int64_t step = kExported + 1; step <= last; ++step) {
      const Dict rec = load_dict(step_file(*dir, "step", step));
      const std::int64_t now = rec.at("counter.n_averaged").item<std::int64_t>();
      if (now == averaged) continue;
      averaged = now;
      ++later_updates;
      v = (options.decay * v + (1.0 - options.decay) * rec.at("source." + item.key())).to(at::kLong);
    }
    integers.emplace("peer." + item.key(), v);
  }
  CHECK(integers.size() == 1);  // bn.num_batches_tracked
  CHECK(later_updates > 0);
  // test_lightning_lightly.cpp's bound for the callback's avg_fn against emakit's update.
  check_continued(continued, *dir, kSaved, 2.0 + 7.0 * (1.0 - options.decay), "lightning", integers);
  const Dict own = load_dict(step_file(*dir, "step", last));
  std::cout << "lightning round trip: num_batches_tracked "
            << continued.at("peer.bn.num_batches_tracked").item<std::int64_t>() << " after the round trip ("
            << later_updates << " truncating updates after step " << kExported << "), "
            << own.at("peer.bn.num_batches_tracked").item<std::int64_t>() << " in the Python-only run, the model's "
            << own.at("source.bn.num_batches_tracked").item<std::int64_t>() << std::endl;
  fs::remove_all(folder);
}

// ---- The first venv's peers' round trips ----------------------------------------------------
//
// ema-pytorch, timm's ModelEmaV3 and torch's AveragedModel are in the first venv, which CI
// installs: their round trips always run the real package (skipped only in a build without Python).
namespace {

// The scenario `scenario` of `generator`: its state file after `saved` imported into `ema`, emakit
// alone to `exported`, the export loaded by the real `peer` and continued to the last step.
template <class E>
void first_venv_round_trip(const char* peer, const fs::path& dir, std::vector<emakit::SourceTensor>& sources, E& ema,
                           emakit::Peer kind, std::int64_t saved, std::int64_t exported, bool pass_step) {
  REQUIRE(emakit::import_state(ema, kind, step_file(dir, "state", saved)).clean());
  drive(dir, sources, ema, saved + 1, exported, pass_step);
  const fs::path folder = recipe_folder(fmt::format("{}_round_trip", peer).c_str());
  emakit::export_state(ema, kind, folder / "export.pt");
  const fs::path out = folder / "continued.pt";
  REQUIRE(run_round_trip(EMAKIT_CONFORMANCE_PYTHON, peer, dir, folder / "export.pt", exported, out) == 0);
  check_continued(load_dict(out), dir, saved, kLerp, peer);
  fs::remove_all(folder);
}

}  // namespace

// ema_pytorch_peer.py's defaults_with_skips (update_after_step 100, update_every 10; steps 7, 8,
// 55 and 101 not called): saved after 120, emakit 121..140, EMA.load_state_dict and on to 160.
TEST_CASE("ema-pytorch round trip: saved in Python, continued in C++, loaded back by EMA, equals a Python-only run",
          "[conformance][interop][ema-pytorch]") {
  if (!have_python()) EMAKIT_SKIP("no Python (EMAKIT_PYTHON is empty): the round trip runs ema-pytorch");
  const auto dir = scenario_dir("ema_pytorch_peer", "defaults_with_skips");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::ema_pytorch(sources);
  first_venv_round_trip("ema_pytorch", *dir, sources, ema, emakit::Peer::ema_pytorch, 120, 140, false);
}

// averaged_model_peer.py's ema_no_buffers (decay 0.95; steps 4 and 5 not called): saved after 12,
// emakit 13..20, AveragedModel.load_state_dict and on to 30.
TEST_CASE("AveragedModel round trip: saved in Python, continued in C++, loaded back by AveragedModel",
          "[conformance][interop][averaged-model]") {
  if (!have_python()) EMAKIT_SKIP("no Python (EMAKIT_PYTHON is empty): the round trip runs torch");
  const auto dir = scenario_dir("averaged_model_peer", "ema_no_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::averaged_model_ema(sources, {.decay = 0.95, .use_buffers = false});
  first_venv_round_trip("averaged_model", *dir, sources, ema, emakit::Peer::averaged_model, 12, 20, false);
}

// timm_peer.py's warmup_with_step (decay 0.99, min_decay 0.1, update_after_step 2, warmup power
// 3/4; the step given to update()): saved after 25, emakit 26..32, ModelEmaV3.load_state_dict and
// on to 40.
TEST_CASE("timm ModelEmaV3 round trip: saved in Python, continued in C++, loaded back by ModelEmaV3",
          "[conformance][interop][timm]") {
  if (!have_python()) EMAKIT_SKIP("no Python (EMAKIT_PYTHON is empty): the round trip runs timm");
  const auto dir = scenario_dir("timm_peer", "warmup_with_step");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::timm_model_ema_v3(
      sources, {.decay = 0.99, .min_decay = 0.1, .update_after_step = 2, .use_warmup = true, .warmup_power = 0.75});
  first_venv_round_trip("timm_v3", *dir, sources, ema, emakit::Peer::timm_v3, 25, 32, true);
}

}  // namespace test_interop
