// Checkpoint files under faults: processes killed with SIGKILL in the middle of large writes
// (many times, a real child process), and crafted archives that carry code, unknown records,
// foreign globals or tensors larger than their data (refused before LibTorch's loader runs).
#include <emakit/emakit.hpp>
#include <emakit/interop.hpp>
#include <emakit/posthoc.hpp>

#include "../examples/subprocess.hpp"
#include "archive_records.hpp"
#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace test_checkpoint_files {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;

namespace {

namespace fs = std::filesystem;

// ---- archives taken apart and put together again (archive_records.hpp) ----------------------

using emakit_test::read_records;
using emakit_test::Records;
using emakit_test::write_records;
using emakit_test::zip_bytes;

std::string& record(Records& records, const std::string& name) {
  for (auto& [n, bytes] : records)
    if (n == name) return bytes;
  FAIL("no record " << name);
  throw;  // not reached
}

// A pickle by hand: opcodes and operands in protocol 2.
struct Pickle {
  std::string bytes = std::string("\x80\x02", 2);
  Pickle& op(char c) { return bytes += c, *this; }
  Pickle& global(const std::string& module, const std::string& name) {
    return bytes += "c" + module + "\n" + name + "\n", *this;
  }
  Pickle& str(const std::string& s) {
    bytes += 'X';
    for (int i = 0; i < 4; ++i) bytes += static_cast<char>((s.size() >> (8 * i)) & 0xff);
    return bytes += s, *this;
  }
  Pickle& int1(int v) { return bytes += 'K', bytes += static_cast<char>(v), *this; }
  Pickle& mark() { return op('('); }
  Pickle& tuple() { return op('t'); }
};

// A module archive with one float tensor 'w' of `sizes` (strides 1) over a storage of `numel`
// elements whose record holds `data_bytes` bytes: what LibTorch's writer would make for a 1-d
// tensor, with every number chosen by the test.
std::string tensor_archive(int size, int storage_numel, std::size_t data_bytes, const std::string& code_extra = "") {
  Pickle p;
  p.global("__torch__", "Module").op(')').op('\x81').op('}').mark().str("w");
  p.global("torch._utils", "_rebuild_tensor_v2").mark();
  p.mark().str("storage").global("torch", "FloatStorage").str("0").str("cpu").int1(storage_numel).tuple().op('Q');
  p.int1(0).mark().int1(size).tuple().mark().int1(1).tuple().op('\x89');
  p.global("collections", "OrderedDict").op(')').op('R').tuple().op('R');
  p.op('u').op('b').op('.');
  const std::string code =
      "class Module(Module):\n  __parameters__ = [\"w\", ]\n  __buffers__ = []\n  w : Tensor\n" + code_extra;
  std::string data(data_bytes, '\0');
  return zip_bytes({{"data.pkl", p.bytes},
                    {"code/__torch__.py", code},
                    {"constants.pkl", std::string("\x80\x02).", 4)},
                    {"data/0", data}});
}

// ---- a child process killed with SIGKILL --------------------------------------------------

// The writer's model: 4 float parameters of megabytes / 4 MB each.
struct Blob : torch::nn::Module {
  explicit Blob(std::int64_t megabytes) {
    for (int i = 0; i < 4; ++i)
      register_parameter("w" + std::to_string(i), torch::zeros({std::max<std::int64_t>(1, megabytes << 16)}));
  }
};

void fill(torch::nn::Module& m, double value) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.fill_(value);
}

struct Child {
  emakit_subprocess::Process process;
  std::string pending;

  // Runs this test program's hidden test case `test` with `env` added to the environment.
  Child(const std::string& test, const std::vector<std::string>& env)
      : process({emakit_subprocess::own_executable(), test}, {.env = env, .pipe_stdout = true}) {}

  // The next line that starts with "sav" (the writer's; Catch2 prints its own too), or "" at
  // the end of the output or after `timeout`.
  std::string line(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    std::string l;
    while (!(l = any_line(timeout)).empty() && l.rfind("sav", 0) != 0) {
    }
    return l;
  }
  std::string any_line(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (const auto nl = pending.find('\n'); nl != std::string::npos) {
        std::string l = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        return l;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd p{process.stdout_fd(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
      char buf[256];
      const ::ssize_t n = ::read(process.stdout_fd(), buf, sizeof buf);
      if (n <= 0) return "";
      pending.append(buf, static_cast<std::size_t>(n));
    }
  }

  // SIGKILL, reap, and the lines it printed before dying.
  std::vector<std::string> kill() {
    process.signal(SIGKILL);
    const int status = process.wait();
    CHECK(WIFSIGNALED(status));
    std::vector<std::string> rest;
    for (std::string l; !(l = line(std::chrono::milliseconds(500))).empty();) rest.push_back(l);
    return rest;
  }
};

std::int64_t number(const std::string& line, const char* word) {
  if (line.rfind(word, 0) != 0) return -1;
  return std::atoll(line.c_str() + std::string_view(word).size());
}

int rounds() {
  const char* env = std::getenv("EMAKIT_KILL_ROUNDS");
  return env != nullptr ? std::atoi(env) : 8;
}

// Every tensor equals one value; returns it (or -1 when they differ).
double uniform_value(const std::vector<torch::Tensor>& tensors) {
  const double v = tensors.front().flatten()[0].item<double>();
  for (const auto& t : tensors)
    if (!torch::equal(t, torch::full_like(t, v))) return -1;
  return v;
}

// Kills the writer `rounds()` times at random points of its saves (after it has saved at least
// once) and calls check(last_saved, interrupted) after each kill: `interrupted` is the save the
// kill fell into (0 when it fell between saves).
template <class Check>
void kill_during_saves(const std::string& kind, const fs::path& target, int megabytes, const Check& check) {
  std::mt19937 random(20261130);
  int mid_write = 0;
  const int n = rounds();
  for (int round = 0; round < n; ++round) {
    Child child("checkpoint kill-test writer", {"EMAKIT_WRITER_KIND=" + kind, "EMAKIT_WRITER_PATH=" + target.string(),
                                                "EMAKIT_WRITER_MB=" + std::to_string(megabytes)});
    // The first save gives the previous checkpoint and times a save.
    REQUIRE(child.line() == "saving 1");
    const auto start = std::chrono::steady_clock::now();
    REQUIRE(child.line() == "saved 1");
    const auto save_time = std::chrono::steady_clock::now() - start;
    REQUIRE(child.line() == "saving 2");
    // Anywhere in the second save, and now and then just after it.
    const auto delay = std::chrono::duration_cast<std::chrono::microseconds>(
        save_time * std::uniform_real_distribution<double>(0.0, 1.2)(random));
    std::this_thread::sleep_for(delay);
    std::vector<std::string> lines = child.kill();
    std::int64_t saved = 1, interrupted = 2;
    for (const auto& l : lines) {
      if (const auto k = number(l, "saved "); k > 0) saved = k, interrupted = 0;
      if (const auto k = number(l, "saving "); k > 0) interrupted = k;
    }
    if (interrupted != 0) ++mid_write;
    INFO(kind << " round " << round << ": killed " << delay.count() << " us into save 2 (a save takes "
              << std::chrono::duration_cast<std::chrono::microseconds>(save_time).count() << " us); last saved "
              << saved << ", interrupted " << interrupted);
    check(saved, interrupted);
  }
  // Most kills must land inside a write, or the test tests little.
  CHECK(mid_write * 2 >= n);
  WARN(kind << ": " << n << " kills (EMAKIT_KILL_ROUNDS), " << mid_write << " inside a save; every file loaded whole");
}

}  // namespace

// ---- kill -9 ------------------------------------------------------------------------------

// The child of the kill -9 tests (hidden; runs only with EMAKIT_WRITER_KIND set): saves in a
// loop until killed. Save k holds a model whose every weight is k and an EMA of decay 0 (so its
// weights are k too); it prints "saving k" before and "saved k" after, each line flushed.
TEST_CASE("checkpoint kill-test writer", "[.checkpoint-writer]") {
  const char* kind = std::getenv("EMAKIT_WRITER_KIND");
  if (kind == nullptr) return;
  const fs::path path = std::getenv("EMAKIT_WRITER_PATH");
  Blob model(std::atoll(std::getenv("EMAKIT_WRITER_MB")));
  auto say = [](const char* what, std::int64_t k) {
    std::printf("%s %lld\n", what, static_cast<long long>(k));
    std::fflush(stdout);
  };
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(300);  // no orphan runs for ever
  if (std::string_view(kind) == "hook") {
    emakit::EmaHook hook;
    hook.add(model, emakit::Recipe(emakit::Fixed(0.0)));
    hook.setup();
    for (std::int64_t k = 1; std::chrono::steady_clock::now() < give_up; ++k) {
      fill(model, static_cast<double>(k));
      hook.after_optimizer_step({});
      say("saving", k);
      hook.save_checkpoint(path);
      say("saved", k);
    }
  } else {
    emakit::FixedEma ema(model, emakit::Fixed(0.0));
    for (std::int64_t k = 1; std::chrono::steady_clock::now() < give_up; ++k) {
      fill(model, static_cast<double>(k));
      ema.update();
      say("saving", k);
      emakit::save(ema, path);
      say("saved", k);
    }
  }
}

TEST_CASE("kill -9 during EmaHook::save_checkpoint leaves the previous checkpoint whole", "[reliability][kill]") {
  emakit_test::TempDir dir;
  const auto path = dir.path / "last.pt";
  kill_during_saves("hook", path, 48, [&](std::int64_t saved, std::int64_t interrupted) {
    Blob model(48);
    emakit::EmaHook hook;
    hook.add(model, emakit::Recipe(emakit::Fixed(0.0)));
    hook.setup();
    REQUIRE_NOTHROW(hook.load_checkpoint(path));
    const double online = uniform_value(model.parameters());
    const double ema = uniform_value(hook.ema<emakit::Ema<emakit::Fixed>>("model").averages().values());
    // The file holds one whole save: the last one reported, or the interrupted one if the kill
    // came after its rename.
    CHECK(online == ema);
    CHECK((online == static_cast<double>(saved) || (interrupted != 0 && online == static_cast<double>(interrupted))));
    // At most the one temporary file of the interrupted write is left, named as such.
    const auto stale = emakit::interrupted_writes(dir.path);
    CHECK(stale.size() <= 1);
    for (const auto& f : stale) fs::remove(f);
  });
}

TEST_CASE("kill -9 during emakit::save(ema) leaves the previous file whole", "[reliability][kill]") {
  emakit_test::TempDir dir;
  const auto path = dir.path / "ema.pt";
  kill_during_saves("ema", path, 64, [&](std::int64_t saved, std::int64_t interrupted) {
    Blob model(64);
    emakit::FixedEma ema(model, emakit::Fixed(0.0));
    REQUIRE_NOTHROW(emakit::load(ema, path));
    const double value = uniform_value(ema.averages().values());
    CHECK((value == static_cast<double>(saved) || (interrupted != 0 && value == static_cast<double>(interrupted))));
    CHECK(ema.num_updates() == static_cast<std::int64_t>(value));
    const auto stale = emakit::interrupted_writes(dir.path);
    CHECK(stale.size() <= 1);
    for (const auto& f : stale) fs::remove(f);
  });
}

// ---- untrusted archives -------------------------------------------------------------------

TEST_CASE("emakit::save and emakit::load: the torch::save layout, written atomically, read after a check",
          "[reliability][untrusted]") {
  torch::manual_seed(11);
  emakit_test::TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit_test::perturb(*model);
  ema.update();
  emakit_test::TempDir dir;
  emakit::save(ema, dir.path / "a.pt");
  torch::save(ema, (dir.path / "b.pt").string());
  CHECK(emakit::interrupted_writes(dir.path).empty());
  const auto saved = emakit_test::snapshot(ema.averages());

  for (const char* file : {"a.pt", "b.pt"}) {
    emakit_test::perturb(*model);
    ema.update();
    emakit::load(ema, dir.path / file);
    CHECK(emakit_test::same_averages(ema.averages(), saved));
    CHECK(ema.num_updates() == 1);
  }
  emakit::FixedEma other(*model, emakit::Fixed(0.9));  // another config: strict load refuses, nothing changes
  const auto before = emakit_test::snapshot(other.averages());
  REQUIRE_THROWS_WITH(emakit::load(other, dir.path / "a.pt"), Contains("a.pt"));
  CHECK(emakit_test::same_averages(other.averages(), before));
  REQUIRE_THROWS_WITH(emakit::load(ema, dir.path / "missing.pt"), Contains("no file") && Contains("missing.pt"));
}

TEST_CASE("An archive that carries TorchScript code is refused before LibTorch compiles it",
          "[reliability][untrusted]") {
  torch::manual_seed(12);
  emakit_test::TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit_test::TempDir dir;
  emakit::save(ema, dir.path / "good.pt");
  const auto before = emakit_test::snapshot(ema.averages());

  auto records = read_records(dir.path / "good.pt");
  const std::string declarations = record(records, "code/__torch__.py");
  REQUIRE_THAT(declarations, Contains("emakit_state : Dict[str, Tensor]"));

  // A method LibTorch compiles and accepts: the archive is a valid one that carries code.
  record(records, "code/__torch__.py") = declarations + "  def forward(self) -> int:\n    return 1\n";
  write_records(dir.path / "method.pt", records);
  torch::serialize::InputArchive plain;
  REQUIRE_NOTHROW(plain.load_from((dir.path / "method.pt").string()));
  REQUIRE_THROWS_WITH(emakit::load(ema, dir.path / "method.pt"), Contains("refusing") && Contains("method.pt") &&
                                                                     Contains("code/__torch__.py line") &&
                                                                     Contains("def forward") && Contains("no code"));

  // A method that does not compile: LibTorch's loader fails inside its TorchScript compiler
  // (it compiles the archive's code while loading); emakit refuses before, with its own reason.
  record(records, "code/__torch__.py") = declarations + "  def forward(self) -> int:\n    return no_such_name\n";
  write_records(dir.path / "broken.pt", records);
  torch::serialize::InputArchive compiled;
  REQUIRE_THROWS_WITH(compiled.load_from((dir.path / "broken.pt").string()), Contains("no_such_name"));
  REQUIRE_THROWS_WITH(emakit::load(ema, dir.path / "broken.pt"),
                      Contains("refusing") && Contains("def forward") && !Contains("undefined value"));

  // Statements outside a class, a decorator, an import.
  for (const std::string extra :
       {"import os\n", "  @torch.jit.export\n", "print(1)\n", "  x : Tensor = torch.ones(1)\n"}) {
    record(records, "code/__torch__.py") = declarations + extra;
    write_records(dir.path / "extra.pt", records);
    INFO(extra);
    REQUIRE_THROWS_WITH(emakit::load(ema, dir.path / "extra.pt"), Contains("refusing") && Contains("no code"));
  }
  CHECK(emakit_test::same_averages(ema.averages(), before));

  // The hook's loaders check their files the same way.
  emakit::EmaHook hook;
  hook.add(*model, emakit::Recipe(emakit::Fixed(0.5)));
  hook.setup();
  hook.save_checkpoint(dir.path / "hook.pt");
  auto hook_records = read_records(dir.path / "hook.pt");
  record(hook_records, "code/__torch__.py") += "  def forward(self) -> int:\n    return 1\n";
  write_records(dir.path / "hook_method.pt", hook_records);
  REQUIRE_THROWS_WITH(hook.load_checkpoint(dir.path / "hook_method.pt"), Contains("refusing") && Contains("no code"));
  REQUIRE_THROWS_WITH(emakit::load_weights(*model, dir.path / "hook_method.pt"), Contains("refusing"));
  REQUIRE_NOTHROW(hook.load_checkpoint(dir.path / "hook.pt"));
}

TEST_CASE("Unknown records, foreign globals and tensors larger than their data are refused, naming them",
          "[reliability][untrusted]") {
  torch::manual_seed(13);
  emakit_test::TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit_test::TempDir dir;
  emakit::save(ema, dir.path / "good.pt");
  const auto before = emakit_test::snapshot(ema.averages());
  const auto good = read_records(dir.path / "good.pt");

  auto with = [&](const std::string& name, auto edit) {
    auto records = good;
    edit(records);
    const auto path = dir.path / name;
    write_records(path, records);
    return path;
  };
  // An extra record.
  const auto extra = with("extra.pt", [](Records& r) { r.emplace_back("extra/payload.bin", "x"); });
  REQUIRE_THROWS_WITH(emakit::load(ema, extra), Contains("refusing") && Contains("'extra/payload.bin'"));
  // A pickle that calls os.system.
  const auto os_system = with("os_system.pt", [](Records& r) {
    Pickle p;
    p.global("os", "system").str("echo owned").op('\x85').op('R').op('.');
    record(r, "data.pkl") = p.bytes;
  });
  REQUIRE_THROWS_WITH(emakit::load(ema, os_system), Contains("data.pkl") && Contains("the global 'os.system'"));
  // An opcode outside the subset (INST, a class built from a name).
  const auto inst =
      with("inst.pt", [](Records& r) { record(r, "data.pkl") = std::string("\x80\x02(ios\nsystem\n.", 15); });
  REQUIRE_THROWS_WITH(emakit::load(ema, inst), Contains("opcode 0x69") && Contains("outside the accepted subset"));
  // A memo index far past anything made (one flipped byte of a LONG_BINPUT): LibTorch's
  // unpickler would reserve gigabytes for it.
  const auto memo = with("memo.pt", [](Records& r) {
    Pickle p;
    p.op('N').op('r');
    p.bytes += std::string("\x00\x00\x00\x40", 4);  // LONG_BINPUT 0x40000000
    p.op('.');
    record(r, "data.pkl") = p.bytes;
  });
  REQUIRE_THROWS_WITH(emakit::load(ema, memo), Contains("data.pkl") && Contains("memo index 1073741824"));
  // A tensor record cut short: the pickle claims more elements than the record holds.
  const auto short_data = with("short.pt", [](Records& r) { record(r, "data/0").resize(1); });
  REQUIRE_THROWS_WITH(emakit::load(ema, short_data), Contains("the record data/0 holds 1 bytes"));
  // A storage naming a record that is not there.
  const auto missing =
      with("missing.pt", [](Records& r) { std::erase_if(r, [](const auto& rec) { return rec.first == "data/0"; }); });
  REQUIRE_THROWS_WITH(emakit::load(ema, missing), Contains("data/0, which the archive lacks"));
  // Not a zip at all, and an empty file.
  emakit_test::write_bytes(dir.path / "text.pt", "hello");
  REQUIRE_THROWS_WITH(emakit::load(ema, dir.path / "text.pt"), Contains("refusing") && Contains("not a readable zip"));
  emakit_test::write_bytes(dir.path / "empty.pt", "");
  REQUIRE_THROWS_WITH(emakit::load(ema, dir.path / "empty.pt"), Contains("refusing") && Contains("empty.pt"));
  CHECK(emakit_test::same_averages(ema.averages(), before));
}

TEST_CASE("A tensor view that reaches past its storage is refused, the same view inside it is accepted",
          "[reliability][untrusted]") {
  // The hand-made archive is right: LibTorch reads its tensor, and the scan accepts it.
  const std::string ok = tensor_archive(4, 4, 16);
  REQUIRE_NOTHROW(emakit::detail::scan_archive_bytes(ok, "'ok'"));
  torch::serialize::InputArchive archive;
  archive.load_from(ok.data(), ok.size());
  torch::Tensor w;
  archive.read("w", w);
  CHECK(w.sizes() == torch::IntArrayRef{4});

  REQUIRE_THROWS_WITH(emakit::detail::scan_archive_bytes(tensor_archive(8, 4, 16), "'view'"),
                      Contains("sizes [8], strides [1]") && Contains("past its storage of 4 elements"));
  REQUIRE_THROWS_WITH(emakit::detail::scan_archive_bytes(tensor_archive(4, 8, 16), "'numel'"),
                      Contains("claims 8 elements of 4 bytes") && Contains("holds 16 bytes"));
  REQUIRE_THROWS_WITH(emakit::detail::scan_archive_bytes(ok.substr(0, ok.size() / 2), "'half'"),
                      Contains("refusing 'half'"));
}

TEST_CASE("Every file emakit writes passes its own check", "[reliability][untrusted]") {
  torch::manual_seed(14);
  emakit_test::TinyNet model, second;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit::EmaHook hook;
  hook.add(*model, emakit::Recipe(emakit::Fixed(0.5)));
  hook.add("second", *second, emakit::Recipe(emakit::Fixed(0.9)), {.checkpoint_ema_weights = false});
  hook.setup();
  emakit_test::TempDir dir;
  emakit::save(ema, dir.path / "ema.pt");
  torch::save(ema, (dir.path / "torch_save.pt").string());
  hook.save_checkpoint(dir.path / "hook.pt");
  for (const char* file : {"ema.pt", "torch_save.pt", "hook.pt"}) {
    INFO(file);
    CHECK_NOTHROW(emakit::detail::read_scanned_file(dir.path / file, "test"));
  }
}

TEST_CASE("A bit-flipped Ema file is an error or loads exactly what was saved, never else (emakit::load, torch::load)",
          "[reliability][untrusted]") {
  for (const bool checked : {true, false}) {  // emakit::load (checked, errors name the file), torch::load
    INFO((checked ? "emakit::load" : "torch::load"));
    torch::manual_seed(15);
    emakit_test::TinyNet model;
    emakit::FixedEma ema(*model, emakit::Fixed(0.5));
    emakit_test::perturb(*model);
    ema.update();
    emakit_test::TempDir dir;
    const auto good = dir.path / "ema.pt";
    emakit::save(ema, good);
    const auto saved = emakit_test::snapshot(ema.averages());
    emakit_test::perturb(*model);
    ema.update();
    auto current = emakit_test::snapshot(ema.averages());
    int failed = 0, tried = 0, left_to_the_check = 0;
    for (const auto& [file, at] : emakit_test::flipped_copies(good, dir.path)) {
#if defined(__SANITIZE_ADDRESS__)
      // torch::load hands the file to LibTorch's reader before emakit sees it, and a flipped record
      // size makes that reader allocate it (26 GB at one byte of today's layout): a std::bad_alloc,
      // an error like the others, everywhere but under ASan, whose operator new aborts instead. Under
      // ASan such a file is left to the checked path, which refuses it before LibTorch reads it.
      if (!checked) {
        bool refused = false;
        try {
          static_cast<void>(emakit::detail::read_scanned_file(file, "test"));
        } catch (const std::exception&) {
          refused = true;
        }
        if (refused) {
          ++left_to_the_check;
          continue;
        }
      }
#endif
      ++tried;
      INFO("byte " << at);
      try {
        if (checked)
          emakit::load(ema, file);
        else
          torch::load(ema, file.string());
        CHECK(emakit_test::same_averages(ema.averages(), saved));  // loaded: exactly the saved values
        current = saved;
      } catch (const std::exception& e) {
        ++failed;
        if (checked) CHECK_THAT(e.what(), Contains(file.filename().string()));
        CHECK(emakit_test::same_averages(ema.averages(), current));  // failed: nothing changed
      }
    }
    INFO(left_to_the_check << " files left to the checked path (ASan only)");
    CHECK(tried + left_to_the_check >= 40);
    CHECK(tried >= 20);
    // The flips hit what a reader checks often enough (under ASan the torch::load path keeps only
    // files the scanner accepts, which mostly load the saved values: the checked path counts there).
    if (left_to_the_check == 0) CHECK(failed >= tried / 4);
  }
}

TEST_CASE("A checkpoint of another format version is an error naming both versions and the writer's emakit",
          "[reliability]") {
  torch::manual_seed(16);
  emakit_test::TinyNet model;
  emakit_test::TempDir dir;
  {  // a hook checkpoint whose format is 99, written by "emakit 9.9.9"
    torch::serialize::OutputArchive archive;
    torch::serialize::OutputArchive hook(archive.compilation_unit());
    hook.write("format", torch::scalar_tensor(99, torch::kLong));
    hook.write("emakit_version", c10::IValue(std::string("9.9.9")));
    archive.write("emakit_hook", hook);
    archive.save_to((dir.path / "hook99.pt").string());
  }
  emakit::EmaHook hook;
  hook.add(*model, emakit::Recipe(emakit::Fixed(0.5)));
  hook.setup();
  REQUIRE_THROWS_WITH(hook.load_checkpoint(dir.path / "hook99.pt"),
                      Contains("emakit hook checkpoint version 99 (written by emakit 9.9.9); this emakit (") &&
                          Contains(std::string(emakit::version_string)) && Contains("reads version 1") &&
                          Contains("update emakit") && Contains("hook99.pt"));
  REQUIRE_THROWS_AS(hook.load_checkpoint(dir.path / "hook99.pt"), emakit::FormatVersionError);

  {  // an Ema file whose state says format 99
    emakit::FixedEma ema(*model, emakit::Fixed(0.5));
    auto state = ema.state_dict();
    state["emakit.format"] = torch::scalar_tensor(99, torch::kLong);
    std::vector<std::pair<std::string, torch::Tensor>> items;
    emakit::detail::Checksums sums;
    for (const auto& item : state) {
      items.emplace_back(item.key(), item.value());
      sums.add(item.key(), item.value());
    }
    torch::serialize::OutputArchive archive;
    archive.write("emakit_state", emakit::detail::tensor_dict(items, false));
    archive.write("emakit_checksums", emakit::detail::tensor_dict(sums.saved, false));
    archive.write("emakit_version", c10::IValue(std::string("9.9.9")));
    archive.save_to((dir.path / "ema99.pt").string());
  }
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  REQUIRE_THROWS_WITH(emakit::load(ema, dir.path / "ema99.pt"), Contains("emakit EMA state version 99") &&
                                                                    Contains("written by emakit 9.9.9") &&
                                                                    Contains("ema99.pt"));
  // The file's name and writer are appended without losing the error's type.
  REQUIRE_THROWS_AS(emakit::load(ema, dir.path / "ema99.pt"), emakit::FormatVersionError);
  // The version is recorded by every writer.
  emakit::save(ema, dir.path / "now.pt");
  torch::serialize::InputArchive now;
  now.load_from((dir.path / "now.pt").string());
  c10::IValue writer;
  REQUIRE(now.try_read("emakit_version", writer));
  CHECK(writer.toStringRef() == emakit::version_string);
}

TEST_CASE("import_state checks a torch.save file before LibTorch's unpickler reads it", "[reliability][untrusted]") {
  torch::manual_seed(17);
  emakit_test::TinyNet model;
  auto ema = emakit::averaged_model_ema(*model);
  emakit_test::TempDir dir;
  // A dict whose value is a call of os.system: refused at the global, nothing is unpickled.
  Pickle p;
  p.op('}').mark().str("n_averaged").global("os", "system").str("true").op('\x85').op('R').op('u').op('.');
  emakit_test::write_bytes(dir.path / "code.pt", zip_bytes({{"data.pkl", p.bytes}, {"version", "3\n"}}));
  const auto before = emakit_test::snapshot(ema.averages());
  REQUIRE_THROWS_WITH(emakit::import_state(ema, emakit::Peer::averaged_model, dir.path / "code.pt"),
                      Contains("import_state: refusing") && Contains("code.pt") && Contains("os.system"));
  // A module archive is not a torch.save dict.
  emakit::save(ema, dir.path / "module.pt");
  REQUIRE_THROWS_WITH(emakit::import_state(ema, emakit::Peer::averaged_model, (dir.path / "module.pt").string()),
                      Contains("refusing") && Contains("not a dict"));
  CHECK(emakit_test::same_averages(ema.averages(), before));
  // What export_state writes passes the check and loads back.
  emakit::export_state(ema, emakit::Peer::averaged_model, dir.path / "export.pt");
  CHECK(emakit::import_state(ema, emakit::Peer::averaged_model, dir.path / "export.pt").clean());
}

// ---- a torch.save dict, built from the values the scan's checker ran -------------------------

// read_pickle_dict of a torch.save-like file holding `pickle` as data.pkl and `extra` records.
c10::impl::GenericDict read_dict(const std::string& pickle, const Records& extra = {}) {
  emakit_test::TempDir dir;
  Records records{{"data.pkl", pickle}, {"version", "3\n"}};
  records.insert(records.end(), extra.begin(), extra.end());
  emakit_test::write_bytes(dir.path / "dict.pt", zip_bytes(records));
  return emakit::detail::read_pickle_dict(dir.path / "dict.pt", "test");
}

std::string be_double(double v) {  // BINFLOAT's operand
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof v);
  std::string out;
  for (int i = 7; i >= 0; --i) out += static_cast<char>((bits >> (8 * i)) & 0xff);
  return out;
}

// An OrderedDict root (torch.save(state_dict())) in the shapes Python pickles: a root-level
// SETITEM, an OrderedDict inside a list with its _metadata (BUILD), a float, one list reached
// twice through the memo, a key set twice, a typed list (LibTorch's build_intlist), a tensor
// saved from 'cuda:0' and a view of it sharing its storage, and the root's own _metadata.
TEST_CASE("read_pickle_dict builds the dict a pickle holds: OrderedDicts, memo, repeated keys, typed lists, views",
          "[reliability][untrusted][interop]") {
  Pickle p;
  p.global("collections", "OrderedDict").op('q').op('\x00').op(')').op('R').op('q').op('\x01');
  p.str("a").int1(1).op('s');                                                                   // a = 1
  p.str("l").op(']').op('h').op('\x00').op(')').op('R').op('q').op('\x02');                     // l = [OrderedDict(
  p.str("b").int1(2).op('s').op('}').str("_metadata").op('}').op('s').op('b').op('a').op('s');  // b=2)]
  p.str("f").op('G');
  p.bytes += be_double(-2.5);
  p.op('s');                                                                      // f = -2.5
  p.str("s").op(']').op('q').op('\x03').mark().int1(7).str("x").op('e').op('s');  // s = [7, 'x']
  p.str("s2").op('h').op('\x03').op('s');                                         // s2 = s (the same list)
  p.str("a").int1(3).op('s');                                                     // a = 3: first place kept
  p.str("ints").global("torch.jit._pickle", "build_intlist").mark().op(']').mark().int1(4).int1(5).op('e');
  p.tuple().op('R').op('s');  // ints = build_intlist([4, 5])
  const auto storage = [&] {
    p.mark().str("storage").global("torch", "FloatStorage").str("0").str("cuda:0").int1(6).tuple().op('Q');
  };
  p.mark().str("w").global("torch._utils", "_rebuild_tensor_v2").mark();  // w: 2x3 of storage 0
  storage();
  p.int1(0).mark().int1(2).int1(3).tuple().mark().int1(3).int1(1).tuple().op('\x88').op('}').tuple().op('R');
  p.str("wt").global("torch._utils", "_rebuild_tensor_v2").mark();  // wt: w's column 1, a view
  storage();
  p.int1(1).mark().int1(2).tuple().mark().int1(3).tuple().op('\x89').op('}').tuple().op('R').op('u');
  p.op('}').str("_metadata").op('}').op('s').op('b').op('.');

  std::string data;
  for (int i = 0; i < 6; ++i) {
    const float v = 0.5F + static_cast<float>(i);
    data.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  const auto read = read_dict(p.bytes, {{"data/0", data}});
  std::vector<std::string> keys;
  for (const auto& item : read) keys.push_back(item.key().toStringRef());
  CHECK(keys == std::vector<std::string>{"a", "l", "f", "s", "s2", "ints", "w", "wt"});
  CHECK(read.at("a").toInt() == 3);
  const auto list = read.at("l").toListRef();
  REQUIRE(list.size() == 1);
  const auto inner = list[0].toGenericDict();
  REQUIRE(inner.size() == 1);  // b, without _metadata
  CHECK(inner.at("b").toInt() == 2);
  CHECK(read.at("f").toDouble() == -2.5);
  const auto shared = read.at("s").toList();
  REQUIRE(shared.size() == 2);
  CHECK(shared.get(0).toInt() == 7);
  CHECK(shared.get(1).toStringRef() == "x");
  CHECK(read.at("s").isSameIdentity(read.at("s2")));  // one list, as Python reads it
  REQUIRE(read.at("ints").isIntList());
  CHECK(read.at("ints").toIntVector() == std::vector<std::int64_t>{4, 5});
  const auto w = read.at("w").toTensor();
  const auto wt = read.at("wt").toTensor();
  CHECK(w.device().is_cpu());  // saved from cuda:0, read where every caller reads it first
  CHECK(w.requires_grad());
  CHECK_FALSE(wt.requires_grad());
  CHECK(torch::equal(w.detach(), torch::arange(6, torch::kFloat).add(0.5).view({2, 3})));
  CHECK(torch::equal(wt, torch::tensor({1.5F, 4.5F})));
  CHECK(wt.stride(0) == 3);
  CHECK(wt.storage().is_alias_of(w.storage()));  // one record, one storage
}

// What a pickle can hold but a dict of tensors may not, each refused by name before anything is
// built: a container holding itself, containers nested past the limit, a global, a storage
// outside a tensor, a typed list with another kind in it, a file from a big-endian machine; and
// a tensor LibTorch refuses as it is made (an integer one that requires grad), named as such.
TEST_CASE("read_pickle_dict refuses cycles, deep nesting, globals, bare storages, mistyped lists and big-endian files",
          "[reliability][untrusted][interop]") {
  const auto refused = [](const std::string& pickle, const Records& extra = {}) {
    try {
      (void)read_dict(pickle, extra);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(read)");
  };
  Pickle cycle;  // d['d'] = d
  cycle.op('}').op('q').op('\x00').str("d").op('h').op('\x00').op('s').op('.');
  CHECK_THAT(refused(cycle.bytes), Contains("refusing") && Contains("data.pkl holds a dict that holds itself"));
  Pickle list_cycle;  // {'l': l} with l = [l]
  list_cycle.op('}').str("l").op(']').op('q').op('\x00').op('h').op('\x00').op('a').op('s').op('.');
  CHECK_THAT(refused(list_cycle.bytes), Contains("a list that holds itself"));

  const auto nested = [](std::size_t depth) {  // {'x': [[...[]...]]}, `depth` containers in all
    Pickle p;
    p.op('}').str("x");
    for (std::size_t i = 1; i < depth; ++i) p.op(']');
    for (std::size_t i = 2; i < depth; ++i) p.op('a');
    return p.op('s').op('.').bytes;
  };
  const std::size_t limit = emakit::detail::archive_scan::PickleValues::max_depth;
  const auto deepest = read_dict(nested(limit));
  std::size_t lists = 0;
  for (c10::IValue v = deepest.at("x");; v = v.toListRef()[0]) {
    ++lists;
    if (v.toListRef().empty()) break;
  }
  CHECK(lists == limit - 1);  // inside the root dict: `limit` containers deep
  CHECK_THAT(refused(nested(limit + 1)), Contains("nests containers more than 1000 deep"));

  Pickle global;
  global.op('}').str("g").global("collections", "OrderedDict").op('s').op('.');
  CHECK_THAT(refused(global.bytes), Contains("holds a global inside its dict"));
  Pickle bare;
  bare.op('}').str("s").mark().str("storage").global("torch", "FloatStorage").str("0").str("cpu").int1(1);
  bare.tuple().op('Q').op('s').op('.');
  CHECK_THAT(refused(bare.bytes, {{"data/0", std::string(4, '\0')}}), Contains("holds a storage inside its dict"));
  Pickle typed;  // build_intlist([4.0])
  typed.op('}').str("i").global("torch.jit._pickle", "build_intlist").mark().op(']').op('G');
  typed.bytes += be_double(4.0);
  typed.op('a').tuple().op('R').op('s').op('.');
  CHECK_THAT(refused(typed.bytes), Contains("holds a list of int values with a float in it"));
  Pickle grad;  // a long tensor that requires grad: checked by LibTorch as the tensor is made
  grad.op('}').str("t").global("torch._utils", "_rebuild_tensor_v2").mark();
  grad.mark().str("storage").global("torch", "LongStorage").str("0").str("cpu").int1(1).tuple().op('Q');
  grad.int1(0).mark().int1(1).tuple().mark().int1(1).tuple().op('\x88').op('}').tuple().op('R').op('s').op('.');
  CHECK_THAT(refused(grad.bytes, {{"data/0", std::string(8, '\0')}}),
             Contains("is not a file torch.save wrote with a dict of tensors") && Contains("require"));
  Pickle plain;
  plain.op('}').str("k").int1(1).op('s').op('.');
  CHECK(read_dict(plain.bytes, {{"byteorder", "little"}}).at("k").toInt() == 1);
  CHECK_THAT(refused(plain.bytes, {{"byteorder", "big"}}), Contains("its byteorder record says 'big'"));
}

// Any dict of plain values and tensors LibTorch's own writer (torch::pickle_save, which torch.load
// reads) makes, read back as it was: generated trees of None, bools, ints over the whole int64
// range, doubles of any bits, strings, tuples, lists (generic and typed), dicts with str and int
// keys, and tensors of every storage dtype, as views (offsets, strides, transposes) sharing
// storages, some requiring grad. Compared value for value with the tree written and with
// LibTorch's own unpickler's reading of the same bytes; tensors bitwise, with their views.
class TreeGen {
 public:
  explicit TreeGen(std::uint64_t seed) : rng_(seed), gen_(at::detail::createCPUGenerator(seed)) {}

  c10::impl::GenericDict root() {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    const int n = pick(1, 8);
    for (int i = 0; i < n; ++i)
      d.insert_or_assign("k" + std::to_string(i) + text(), pick(0, 2) == 0 ? c10::IValue(tensor()) : value(0));
    return d;
  }

 private:
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  std::string text() {
    std::string s;
    const int n = pick(0, 6);
    for (int i = 0; i < n; ++i) s += pick(0, 9) == 0 ? std::string("\xc3\xa9") : std::string(1, char(pick(32, 126)));
    return s;
  }
  double real() {
    if (pick(0, 3) == 0) {
      std::uint64_t bits = rng_();
      double v = 0;
      std::memcpy(&v, &bits, sizeof v);  // any bits: NaNs, infinities, subnormals, -0
      return v;
    }
    return std::normal_distribution<double>(0, 10)(rng_);
  }
  std::int64_t integer() {
    switch (pick(0, 3)) {
      case 0: return pick(-300, 300);
      case 1: return pick(-70000, 70000);
      case 2: return static_cast<std::int64_t>(rng_()) >> pick(0, 62);
      default: return static_cast<std::int64_t>(rng_());
    }
  }
  at::Tensor tensor() {
    static const c10::ScalarType dtypes[] = {at::kFloat, at::kDouble, at::kHalf,         at::kBFloat16,
                                             at::kLong,  at::kInt,    at::kShort,        at::kChar,
                                             at::kByte,  at::kBool,   at::kComplexFloat, at::kComplexDouble};
    if (!made_.empty() && pick(0, 2) == 0) {  // a view of a storage made before
      const at::Tensor& base = made_[static_cast<std::size_t>(pick(0, static_cast<int>(made_.size()) - 1))];
      // Not of an empty one (nor a slice of it below): LibTorch 2's unpickler refuses an offset into a
      // storage of 0 bytes, which emakit reads (an empty view, as Python's torch.load reads it).
      if (base.dim() >= 1 && base.size(0) > 1 && base.numel() > 0)
        return pick(0, 1) == 0 ? base.narrow(0, 1, base.size(0) - 1) : base;
    }
    const auto dtype = dtypes[pick(0, 11)];
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(pick(0, 3)));
    for (auto& s : sizes) s = pick(0, 4);
    at::Tensor t = at::randn(sizes, gen_, at::kDouble).mul(100);  // its own generator: the global one untouched
    t = dtype == at::kBool ? t.gt(0) : t.to(dtype);
    if (t.dim() >= 2 && pick(0, 1) == 0) t = t.transpose(0, 1);
    if (t.dim() >= 1 && t.size(0) > 2 && t.numel() > 0 && pick(0, 2) == 0) t = t.slice(0, 1, t.size(0), 2);
    if (at::isFloatingType(dtype) && pick(0, 3) == 0) t = t.detach().requires_grad_(true);
    made_.push_back(t);
    return t;
  }
  c10::IValue value(int depth) {
    const int kind = pick(0, depth >= 3 ? 5 : 10);
    switch (kind) {
      case 0: return {};
      case 1: return pick(0, 1) == 1;
      case 2: return integer();
      case 3: return real();
      case 4: return text();
      case 5: return tensor();
      case 6: {  // a tuple
        std::vector<c10::IValue> items;
        for (int i = pick(0, 3); i > 0; --i) items.push_back(value(depth + 1));
        return c10::ivalue::Tuple::create(std::move(items));
      }
      case 7: {  // a generic list
        c10::impl::GenericList l(c10::AnyType::get());
        for (int i = pick(0, 4); i > 0; --i) l.push_back(value(depth + 1));
        return l;
      }
      case 8: {  // a typed list (pickle_save writes build_intlist ...)
        switch (pick(0, 3)) {
          case 0: {
            c10::List<std::int64_t> l;
            for (int i = pick(0, 4); i > 0; --i) l.push_back(integer());
            return l;
          }
          case 1: {
            c10::List<double> l;
            for (int i = pick(0, 4); i > 0; --i) l.push_back(real());
            return l;
          }
          case 2: {
            c10::List<bool> l;
            for (int i = pick(0, 4); i > 0; --i) l.push_back(pick(0, 1) == 1);
            return l;
          }
          default: {
            c10::List<at::Tensor> l;
            for (int i = pick(0, 3); i > 0; --i) l.push_back(tensor());
            return l;
          }
        }
      }
      case 9: {  // a dict with int keys
        c10::impl::GenericDict d(c10::IntType::get(), c10::AnyType::get());
        for (int i = pick(0, 3); i > 0; --i) d.insert_or_assign(integer(), value(depth + 1));
        return d;
      }
      default: {
        c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
        for (int i = pick(0, 3); i > 0; --i) d.insert_or_assign(text(), value(depth + 1));
        return d;
      }
    }
  }

  std::mt19937_64 rng_;
  at::Generator gen_;
  std::vector<at::Tensor> made_;
};

struct Compared {
  std::size_t values = 0, tensors = 0, typed_lists = 0, shared_storages = 0;
};

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  const auto ca = a.detach().contiguous(), cb = b.detach().contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

// `read` is `want`, kind for kind (a typed list as typed), value for value; counts into `c`.
void check_same(const c10::IValue& want, const c10::IValue& read, Compared& c) {
  ++c.values;
  REQUIRE(std::string(read.tagKind()) == std::string(want.tagKind()));
  if (want.isTensor()) {
    const auto w = want.toTensor(), r = read.toTensor();
    CHECK(r.scalar_type() == w.scalar_type());
    CHECK(r.sizes() == w.sizes());
    CHECK(r.strides() == w.strides());
    CHECK(r.storage_offset() == w.storage_offset());
    CHECK(r.requires_grad() == w.requires_grad());
    CHECK(same_bits(r, w));
    ++c.tensors;
  } else if (want.isDouble()) {
    const double w = want.toDouble(), r = read.toDouble();
    CHECK(std::memcmp(&w, &r, sizeof w) == 0);
  } else if (want.isTuple()) {
    const auto& w = want.toTupleRef().elements();
    const auto& r = read.toTupleRef().elements();
    REQUIRE(r.size() == w.size());
    for (std::size_t i = 0; i < w.size(); ++i) check_same(w[i], r[i], c);
  } else if (want.isList()) {
    CHECK(read.isIntList() == want.isIntList());
    CHECK(read.isDoubleList() == want.isDoubleList());
    CHECK(read.isBoolList() == want.isBoolList());
    CHECK(read.isTensorList() == want.isTensorList());
    if (want.isIntList() || want.isDoubleList() || want.isBoolList() || want.isTensorList()) ++c.typed_lists;
    const auto w = want.toListRef();
    const auto r = read.toListRef();
    REQUIRE(r.size() == w.size());
    for (std::size_t i = 0; i < w.size(); ++i) check_same(w[i], r[i], c);
  } else if (want.isGenericDict()) {
    const auto w = want.toGenericDict(), r = read.toGenericDict();
    REQUIRE(r.size() == w.size());
    auto ri = r.begin();
    for (const auto& item : w) {  // in order
      check_same(item.key(), ri->key(), c);
      check_same(item.value(), ri->value(), c);
      ++ri;
    }
  } else {
    CHECK(read == want);  // None, bool, int, str
  }
}

TEST_CASE("Any dict of plain values and tensors torch::pickle_save writes reads back as written, bitwise",
          "[reliability][untrusted][interop]") {
  emakit_test::TempDir dir;
  Compared c, unpickled;
  for (std::uint64_t seed = 0; seed < 150; ++seed) {
    INFO("seed " << seed);
    const c10::IValue tree = TreeGen(seed).root();
    const std::vector<char> bytes = torch::pickle_save(tree);
    const fs::path file = dir.path / ("tree" + std::to_string(seed) + ".pt");
    emakit_test::write_bytes(file, std::string(bytes.data(), bytes.size()));
    const c10::IValue read = emakit::detail::read_pickle_dict(file, "test");
    check_same(tree, read, c);
    check_same(torch::pickle_load(bytes), read, unpickled);  // LibTorch's own reading of the same bytes
    // Tensors of one storage share one storage when read, as when written.
    std::vector<at::Tensor> written, loaded;
    const std::function<void(const c10::IValue&, std::vector<at::Tensor>&)> tensors =
        [&](const c10::IValue& v, std::vector<at::Tensor>& out) {
          if (v.isTensor()) out.push_back(v.toTensor());
          if (v.isTuple())
            for (const auto& e : v.toTupleRef().elements()) tensors(e, out);
          if (v.isList())
            for (const auto& e : v.toListRef()) tensors(e, out);
          if (v.isGenericDict())
            for (const auto& e : v.toGenericDict()) tensors(e.value(), out);
        };
    tensors(tree, written);
    tensors(read, loaded);
    REQUIRE(loaded.size() == written.size());
    for (std::size_t i = 0; i < written.size(); ++i)
      for (std::size_t j = i + 1; j < written.size(); ++j)
        if (written[i].storage().is_alias_of(written[j].storage())) {
          CHECK(loaded[i].storage().is_alias_of(loaded[j].storage()));
          ++c.shared_storages;
        }
  }
  // Seeds 0..149 make 2445 values, 373 tensors, 69 typed lists and 41 pairs of tensors of one storage.
  CHECK(c.values > 2000);
  CHECK(c.tensors > 300);
  CHECK(c.typed_lists > 50);
  CHECK(c.shared_storages > 30);
  CHECK(unpickled.values == c.values);
}

// ---- the bytes checked are the bytes loaded ----------------------------------------------------

// What the after-scan seam puts in place of the file just scanned, as another process writing the
// folder would: a copy renamed over it (the path then names another file).
fs::path swap_source;  // NOLINT: read by a plain function pointer
int swaps = 0;         // NOLINT

void swap_in(const fs::path& scanned) {
  const fs::path temp = scanned.string() + ".swap";
  fs::copy_file(swap_source, temp, fs::copy_options::overwrite_existing);
  fs::rename(temp, scanned);
  ++swaps;
}

// Sets the seam for one scope.
struct SwapAfterScan {
  explicit SwapAfterScan(fs::path source) {
    swap_source = std::move(source);
    swaps = 0;
    emakit::detail::testing::after_scan() = &swap_in;
  }
  SwapAfterScan(const SwapAfterScan&) = delete;
  SwapAfterScan& operator=(const SwapAfterScan&) = delete;
  ~SwapAfterScan() { emakit::detail::testing::after_scan() = nullptr; }
};

TEST_CASE("A checkpoint replaced between the scan and the load: what loads is what was scanned",
          "[reliability][untrusted]") {
  torch::manual_seed(18);
  emakit_test::TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit_test::perturb(*model);
  ema.update();
  emakit_test::TempDir dir;
  emakit::save(ema, dir.path / "scanned.pt");
  const auto scanned = emakit_test::snapshot(ema.averages());
  emakit_test::perturb(*model);
  ema.update();
  emakit::save(ema, dir.path / "other.pt");  // a valid checkpoint of other values
  const auto other = emakit_test::snapshot(ema.averages());
  REQUIRE_FALSE(emakit_test::same_averages(ema.averages(), scanned));
  // A file the scan refuses and LibTorch loads (it compiles and keeps the method).
  auto records = read_records(dir.path / "scanned.pt");
  record(records, "code/__torch__.py") += "  def forward(self) -> int:\n    return 1\n";
  write_records(dir.path / "hostile.pt", records);
  REQUIRE_THROWS_WITH(emakit::load(ema, dir.path / "hostile.pt"), Contains("refusing") && Contains("def forward"));

  for (const char* replacement : {"other.pt", "hostile.pt"}) {
    INFO("replaced by " << replacement);
    fs::copy_file(dir.path / "scanned.pt", dir.path / "target.pt", fs::copy_options::overwrite_existing);
    const std::string replacement_bytes = emakit_test::read_bytes(dir.path / replacement);
    {
      const SwapAfterScan seam(dir.path / replacement);
      emakit::load(ema, dir.path / "target.pt");
      CHECK(swaps == 1);
    }
    CHECK(emakit_test::read_bytes(dir.path / "target.pt") == replacement_bytes);  // the path holds the new file
    CHECK(emakit_test::same_averages(ema.averages(), scanned));                   // and the scanned one loaded
    emakit::load(ema, dir.path / "other.pt");
    CHECK(emakit_test::same_averages(ema.averages(), other));
  }

  // import_state's torch.save dicts: the same.
  auto peer = emakit::averaged_model_ema(*model);
  peer.update();
  emakit::export_state(peer, emakit::Peer::averaged_model, dir.path / "export_a.pt");
  const auto exported = emakit_test::snapshot(peer.averages());
  emakit_test::perturb(*model);
  peer.update();
  emakit::export_state(peer, emakit::Peer::averaged_model, dir.path / "export_b.pt");
  REQUIRE_FALSE(emakit_test::same_averages(peer.averages(), exported));
  {
    const SwapAfterScan seam(dir.path / "export_b.pt");
    CHECK(emakit::import_state(peer, emakit::Peer::averaged_model, dir.path / "export_a.pt").clean());
    CHECK(swaps == 1);
  }
  CHECK(emakit_test::same_averages(peer.averages(), exported));
  CHECK(emakit_test::read_bytes(dir.path / "export_a.pt") == emakit_test::read_bytes(dir.path / "export_b.pt"));
}

TEST_CASE("The format registry holds the version every writer stores", "[reliability]") {
  namespace formats = emakit::detail::formats;
  STATIC_REQUIRE(emakit::state_format_version == formats::ema_state.version);
  STATIC_REQUIRE(emakit::hook_format_version == formats::hook.version);
  STATIC_REQUIRE(emakit::detail::snapshot_format_version == formats::snapshot.version);
  emakit_test::TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  CHECK(ema.state_dict()["emakit.format"].item<std::int64_t>() == formats::ema_state.version);
}

TEST_CASE("match_by_name pairs tensors by name and lists what is missing, misshapen or unexpected, in order",
          "[reliability]") {
  using Kind = emakit::detail::NameMatch::Problem::Kind;
  const std::vector<std::pair<std::string, torch::Tensor>> ours = {
      {"a", torch::zeros({2})}, {"b", torch::zeros({3})}, {"c", torch::zeros({1})}};
  const std::unordered_map<std::string, torch::Tensor> theirs = {
      {"a", torch::ones({2})}, {"b", torch::ones({4})}, {"d", torch::ones({1})}};
  const auto m = emakit::detail::match_by_name(ours, theirs, /*want_unexpected=*/true);
  REQUIRE(m.pairs.size() == 1);
  CHECK(m.pairs[0].name == "a");
  CHECK(torch::equal(m.pairs[0].theirs, torch::ones({2})));
  REQUIRE(m.problems.size() == 3);
  CHECK((m.problems[0].kind == Kind::shape && m.problems[0].name == "b" && m.problems[0].ours_shape == "[3]" &&
         m.problems[0].theirs_shape == "[4]"));
  CHECK((m.problems[1].kind == Kind::missing && m.problems[1].name == "c"));
  CHECK((m.problems[2].kind == Kind::unexpected && m.problems[2].name == "d"));
  CHECK(emakit::detail::match_by_name(ours, theirs).problems.size() == 2);
}

TEST_CASE("StateReader reads counters and config values, naming the key of a bad one", "[reliability]") {
  emakit::StateDict state;
  state.insert("n", torch::scalar_tensor(7, torch::kLong));
  state.insert("negative", torch::scalar_tensor(-1, torch::kLong));
  state.insert("real", torch::scalar_tensor(0.5, torch::kDouble));
  state.insert("text", emakit::detail::string_tensor("fixed"));
  const emakit::detail::StateReader in(state);
  CHECK(in.counter("n") == 7);
  CHECK(in.number("real") == 0.5);
  CHECK(in.optional_text("text") == std::optional<std::string>("fixed"));
  CHECK_FALSE(in.optional_integer("absent").has_value());
  CHECK_THROWS_WITH(in.counter("absent"), Contains("the state has no 'absent'"));
  CHECK_THROWS_WITH(in.counter("negative"), Contains("'negative' must be >= 0, got -1"));
  CHECK_THROWS_WITH(in.counter("real"), Contains("'real' must be one integer"));
}

TEST_CASE("first_line keeps the first line of an error, without c10's backtrace", "[reliability]") {
  CHECK(emakit::detail::first_line("one\ntwo") == "one");
  CHECK(emakit::detail::first_line("single") == "single");
  try {
    TORCH_CHECK(false, "the reason");
  } catch (const c10::Error& e) {
    CHECK_THAT(emakit::detail::first_line(e), Contains("the reason") && !Contains("\n"));
  }
}

}  // namespace test_checkpoint_files
