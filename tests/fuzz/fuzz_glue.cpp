// The loading half of the fuzz target (fuzz_checkpoint.cpp has the why): what emakit does with
// bytes its archive check accepted, and the seed corpus. Built with g++, not instrumented.
#include <emakit/aliases.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/hooks.hpp>

#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc = register_module("fc", torch::nn::Linear(3, 2));
    register_buffer("steps", torch::zeros({1}, torch::kLong));
  }
  torch::nn::Linear fc{nullptr};
};

std::string bytes_of(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void make_corpus(const std::filesystem::path& folder) {
  std::filesystem::create_directories(folder);
  torch::manual_seed(0);
  Net net;
  emakit::FixedEma ema(net, emakit::Fixed(0.5));
  ema.update();
  torch::serialize::OutputArchive a;
  ema.save(a);
  const std::string ema_file = bytes_of(a);

  emakit::EmaHook hook;
  hook.add(net, emakit::Recipe(emakit::Fixed(0.5)));
  hook.setup();
  hook.after_optimizer_step({});
  torch::serialize::OutputArchive h;
  hook.save_checkpoint(h);
  const std::string hook_file = bytes_of(h);

  int n = 0;
  for (const std::string* good : {&ema_file, &hook_file}) {
    write(folder / ("valid-" + std::to_string(n++)), *good);
    for (std::size_t cut : {good->size() / 2, good->size() - 22, std::size_t{64}})  // truncated
      write(folder / ("cut-" + std::to_string(n++)), good->substr(0, cut));
    for (std::size_t at = 64; at < good->size(); at += good->size() / 8) {  // a byte flipped
      std::string flipped = *good;
      flipped[at] = static_cast<char>(flipped[at] ^ 0x5a);
      write(folder / ("flip-" + std::to_string(n++)), flipped);
    }
  }
  std::printf("emakit fuzz: wrote %d seed files to %s\n", n, folder.c_str());
}

}  // namespace

// Valid files (emakit::save / torch::save(ema), hook checkpoints) and broken ones (cut short,
// bytes flipped).
void emakit_fuzz_make_corpus(const char* folder) { make_corpus(folder); }

// LibTorch may still find an accepted file wrong (a bad zip record, a type mismatch) and
// emakit's checks may refuse it; both throw std::exception, never crash.
void emakit_fuzz_load(const char* data, std::size_t size) {
  static Net net;
  static emakit::FixedEma ema(net, emakit::Fixed(0.5));
  static emakit::EmaHook* hook = [] {
    auto* h = new emakit::EmaHook;  // lives for the process, as `net` does
    h->add(net, emakit::Recipe(emakit::Fixed(0.5)));
    h->setup();
    return h;
  }();
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(data, size);
    try {
      ema.load(archive);
    } catch (const std::exception&) {
    }
    hook->load_checkpoint(archive);
  } catch (const std::exception&) {
  }
}
