// Small models and checks shared by the emakit tests.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/ordered_dict.h>

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace emakit_test {

// Linear(3 -> 4), BatchNorm1d(4) (running stats and the int64 num_batches_tracked) and a float
// buffer "scale": parameters, float buffers and a non-float buffer. Cloneable.
template <class Base>
struct TinyBody : Base {
  void build() {
    fc = this->register_module("fc", torch::nn::Linear(3, 4));
    bn = this->register_module("bn", torch::nn::BatchNorm1d(4));
    scale = this->register_buffer("scale", torch::ones({4}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return bn->forward(fc->forward(x)) * scale; }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::Tensor scale;
};

struct TinyNetImpl : TinyBody<torch::nn::Cloneable<TinyNetImpl>> {
  TinyNetImpl() { reset(); }
  void reset() override { build(); }
};
TORCH_MODULE(TinyNet);

// The same architecture, not Cloneable: module storage needs a factory for it.
struct PlainNetImpl : TinyBody<torch::nn::Module> {
  PlainNetImpl() { build(); }
};
TORCH_MODULE(PlainNet);

// Sets every floating tensor of `m` to `value` (no grad).
inline void fill_floats(torch::nn::Module& m, double value) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.fill_(value);
  for (auto& b : m.buffers())
    if (b.is_floating_point()) b.fill_(value);
}

// Adds seeded noise to every parameter, as an optimizer step would.
inline void perturb(torch::nn::Module& m, double scale = 0.1) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.add_(torch::randn_like(p) * scale);
}

// Casts every floating parameter and buffer of `m` to `dtype`, leaving integer buffers alone
// (what Python's module.to(dtype) does).
inline void cast_floats(torch::nn::Module& m, torch::Dtype dtype) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.set_data(p.to(dtype));
  for (auto& b : m.buffers())
    if (b.is_floating_point()) b.set_data(b.to(dtype));
}

// actual == expected up to float rounding of arithmetic on operands of expected's magnitude. An EMA step
// a + w * (b - a) on values near 1 is off by ulps of 1 even where the result is near 0, which
// allclose's default atol (1e-8) refuses for some random draws (and randn draws differ by CPU).
inline bool close_in_float(const torch::Tensor& actual, const torch::Tensor& expected) {
  const double scale = 1.0 + expected.abs().max().item<double>();
  return torch::allclose(actual, expected, 1e-5, 1e-5 * scale);
}

inline bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && torch::equal(a, b);
}

// A fresh folder under the system's temporary folder, removed with everything in it at scope end.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("emakit_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

inline std::string read_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
inline void write_bytes(const std::filesystem::path& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Copies of `file` in `dir`, each with one byte flipped (xor 0x5A), at about 40 places spread
// over the file from byte 64 on: (copy, offset of the flipped byte).
inline std::vector<std::pair<std::filesystem::path, std::size_t>> flipped_copies(const std::filesystem::path& file,
                                                                                const std::filesystem::path& dir) {
  const std::string bytes = read_bytes(file);
  std::vector<std::pair<std::filesystem::path, std::size_t>> out;
  for (std::size_t at = 64; at < bytes.size(); at += bytes.size() / 40) {
    std::string flipped = bytes;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x5A);
    out.emplace_back(dir / ("flipped_" + std::to_string(at) + file.extension().string()), at);
    write_bytes(out.back().first, flipped);
  }
  return out;
}

// A copy of an EMA's averages (Ema::averages()), and whether averages are bitwise those of a copy.
inline std::map<std::string, torch::Tensor> snapshot(const torch::OrderedDict<std::string, torch::Tensor>& averages) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : averages) out.emplace(item.key(), item.value().clone());
  return out;
}
inline bool same_averages(const torch::OrderedDict<std::string, torch::Tensor>& a,
                          const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& item : a)
    if (!bitwise_equal(item.value(), b.at(item.key()))) return false;
  return true;
}

// A copy of every parameter and buffer of `m` by name, and whether two such copies hold the same
// names and bitwise the same tensors.
inline std::map<std::string, torch::Tensor> model_snapshot(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out.emplace(p.key(), p.value().detach().clone());
  for (const auto& b : m.named_buffers()) out.emplace(b.key(), b.value().detach().clone());
  return out;
}
inline bool same_snapshot(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, t] : a)
    if (!b.count(k) || !bitwise_equal(t, b.at(k))) return false;
  return true;
}

// Captures c10 warnings (TORCH_WARN) while alive. The handler API changed in LibTorch 2.
struct WarningCapture : c10::WarningHandler {
  std::vector<std::string> messages;
#if TORCH_VERSION_MAJOR >= 2
  c10::WarningUtils::WarningHandlerGuard guard{this};
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
#else
  c10::Warning::WarningHandlerGuard guard{this};
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override { messages.push_back(msg); }
#endif
};

}  // namespace emakit_test
