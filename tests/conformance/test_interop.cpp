// Moving a run between Python and C++ with the real packages: a state a Python peer saved is
// imported and the run continues in C++ with the peer's numbers; an emakit export is read by
// Python's torch.load (weights_only) and loaded by the peer itself (tests/conformance/_check_export.py).
// The first step after the import starts from the imported state (replay.hpp), so it also shows
// that the import carried the peer's numbers; tolerances as test_peers.cpp (kLerp, derived there).
// The Python side of docs/coming-from-python.md's recipes runs as the page shows it
// (tests/conformance/_doc_recipes.py extracts each block from the page).
#include <emakit/interop.hpp>

#include <caffe2/serialize/inline_container.h>

#include "../../examples/subprocess.hpp"
#include "replay.hpp"

#include <unistd.h>

#include <tuple>
#include <vector>

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
// entries as dict(...) of it (which LibTorch reads itself). An OrderedDict inside a dict is
// refused, naming the fix, and loads nothing.
TEST_CASE("torch.save(state_dict()), an OrderedDict, reads as the dict it holds, and one inside a dict is refused",
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
  CHECK_THROWS_WITH(emakit::import_state(other, emakit::Peer::ema_pytorch, nested),
                    Catch::Matchers::Equals(fmt::format(
                        "emakit: import_state: '{}' holds an OrderedDict inside its dict, which LibTorch cannot "
                        "read; save a plain dict: torch.save(dict(ema.state_dict()), path)",
                        nested)));
  CHECK(torch::equal(other.averages()["lin.weight"], before));
  CHECK(other.num_updates() == 0);
  fs::remove_all(folder);
}
