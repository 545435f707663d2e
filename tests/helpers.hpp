// Small models and checks shared by the emakit tests.
#pragma once

// The tests read emakit's test instrumentation (detail/testing.hpp), which only a build with
// EMAKIT_TESTING has: tests/CMakeLists.txt links every test program to emakit_testing.
#if !defined(EMAKIT_TESTING)
#error "emakit's tests are compiled with EMAKIT_TESTING (link the emakit_testing target of tests/CMakeLists.txt)"
#endif
#include <emakit/detail/testing.hpp>

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/ordered_dict.h>

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
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

// ---- distances in ulps ------------------------------------------------------------------------
//
// ulp(m) in a dtype: the spacing of that dtype's values at magnitude m (2^(floor(log2 m) - p + 1)
// with p the dtype's significand bits; the subnormal spacing below its smallest normal).
//
// Bounds the tests state, in U = one ulp of the average's dtype at M = max(|a|, |x|), the
// magnitude of a lerp's operands (its result can be far smaller than its operands, when a and x
// have opposite signs, so ulps of the result would bound nothing):
//   ATen's lerp formula, a + w(x - a) for |w| < 1/2 else x + (w - 1)(x - a), each operation
//   rounded once in the dtype (the fused CPU pass, _foreach_lerp_): w rounded to the dtype < 1 U
//   (|w - fl(w)| |x - a| <= 2^-p |w| 2M); x - a rounded <= 1 U, times |w| or |w - 1| <= 1/2:
//   1/2 U; the product <= 1/2 U; the sum <= 1 U: 3 U from the exact lerp.
//   LibTorch 1.13's _foreach_mul_ + _foreach_add_, a(1 - w) + w x: 1 - w and w rounded < 1 U
//   together (their weights sum to 1), two products 1/2 U each, the sum 1 U: 3 U.
//   A reference computed in double and rounded once to the dtype: 1/2 U (plus a few double ulps).
//   A half or bf16 average computed in fp32 and rounded once: its fp32 value is 3 fp32 ulps from
//   the exact lerp, the two roundings to the dtype 1/2 U each: 1 U (the results lie on the
//   dtype's grid, whose spacing is U at most, and differ by less than 2 U).

// Significand bits (with the implicit one) and smallest normal exponent of a floating dtype.
inline std::pair<int, int> float_format(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kDouble:
    case torch::kComplexDouble: return {53, -1022};
    case torch::kFloat:
    case torch::kComplexFloat: return {24, -126};
    case torch::kHalf: return {11, -14};
    case torch::kBFloat16: return {8, -126};
    default: TORCH_CHECK(false, "float_format: not a floating dtype: ", dtype);
  }
  return {0, 0};
}

// One ulp of `dtype` at magnitude m (m >= 0, finite).
inline double ulp_of(double m, torch::Dtype dtype) {
  const auto [digits, min_exponent] = float_format(dtype);
  const int e = m > 0 ? std::max(std::ilogb(m), min_exponent) : min_exponent;
  return std::ldexp(1.0, e - (digits - 1));
}

// The largest |a - b| over the elements, in ulps of `dtype` at `scale` (a magnitude per element,
// broadcast to a's shape). Both NaN, or equal infinities: 0; one NaN or a lone infinity: infinity.
// Complex tensors compare their real and imaginary parts. Different shapes: infinity.
inline double max_ulps_at(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& scale,
                          torch::Dtype dtype) {
  if (a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  auto flat = [](const torch::Tensor& t) {
    const auto d = t.detach().cpu();
    return (d.is_complex() ? torch::view_as_real(d.to(torch::kComplexDouble)) : d.to(torch::kDouble))
        .contiguous()
        .reshape({-1});
  };
  const auto s = scale.detach().cpu().to(a.is_complex() ? torch::kComplexDouble : torch::kDouble).expand(a.sizes());
  const auto x = flat(a), y = flat(b), m = flat(s).abs();
  const double* px = x.data_ptr<double>();
  const double* py = y.data_ptr<double>();
  const double* pm = m.data_ptr<double>();
  double worst = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    if (std::isnan(px[i]) || std::isnan(py[i])) {
      if (std::isnan(px[i]) != std::isnan(py[i])) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (px[i] == py[i]) continue;
    if (std::isinf(px[i]) || std::isinf(py[i]) || std::isinf(pm[i])) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::abs(px[i] - py[i]) / ulp_of(pm[i], dtype));
  }
  return worst;
}

// The same in ulps at max(|a|, |b|), in a's dtype unless given.
inline double max_ulps(const torch::Tensor& a, const torch::Tensor& b, torch::Dtype dtype) {
  if (a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  const auto wide = a.is_complex() ? torch::kComplexDouble : torch::kDouble;
  auto magnitude = [&](const torch::Tensor& t) {
    const auto d = t.detach().cpu().to(wide);
    return d.is_complex() ? torch::view_as_real(d).abs() : d.abs();
  };
  auto m = torch::maximum(magnitude(a), magnitude(b));
  if (a.is_complex()) m = torch::view_as_complex(m.contiguous());
  return max_ulps_at(a, b, m, dtype);
}
inline double max_ulps(const torch::Tensor& a, const torch::Tensor& b) { return max_ulps(a, b, a.scalar_type()); }

// max(|a|, |x|) in double: the magnitude of a lerp's operands, for max_ulps_at.
inline torch::Tensor operand_magnitude(const torch::Tensor& a, const torch::Tensor& x) {
  return torch::maximum(a.detach().cpu().to(torch::kDouble).abs(), x.detach().cpu().to(torch::kDouble).abs());
}

// A decay the EMA reports against the policy's d: the EMA averages with w = 1 - d and reports
// 1 - w. For d >= 1/2 both subtractions are exact (Sterbenz); for d < 1/2, 1 - d rounds once in
// [1/2, 1] (2^-54 at most) and 1 - w is exact. So |reported - d| <= 2^-54.
inline bool reported_decay_is(double reported, double d) { return std::abs(reported - d) <= std::ldexp(1.0, -54); }

inline bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && torch::equal(a, b);
}

// A file of the repository, found from this header's own path (tests/helpers.hpp): the README and
// docs/*.md for the tests that check what they say. Throws naming the path when it is missing.
inline std::filesystem::path repo_file(const std::string& relative) {
  const auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / relative;
  TORCH_CHECK(std::filesystem::is_regular_file(path), "repo_file: no file ", path.string(),
              " (the tests read the repository's documentation from the source tree)");
  return path;
}

// C++ code with its whitespace normalised: none, except one space between two word characters
// (what the preprocessor's stringification of the same tokens gives, compared the same way).
inline std::string squeeze_code(const std::string& code) {
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; };
  std::string out;
  bool gap = false;
  for (char c : code) {
    if (std::isspace(static_cast<unsigned char>(c)) != 0) {
      gap = true;
      continue;
    }
    if (gap && !out.empty() && word(out.back()) && word(c)) out += ' ';
    out += c;
    gap = false;
  }
  return out;
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

// The largest resident size of this process since the last reset_peak_resident() (since it
// started, without one), in KiB: VmHWM in /proc/self/status; -1 when it cannot be read.
inline long peak_resident_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::atol(line.c_str() + 6);
  return -1;
}

// Sets the peak resident size to the present one (writes 5 to /proc/self/clear_refs, Linux 4.0
// on), so that a test measures its own peak whatever the test cases before it in this process
// allocated; false when the kernel refuses it.
inline bool reset_peak_resident() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return clear.good();
}

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
inline bool same_snapshot(const std::map<std::string, torch::Tensor>& a,
                          const std::map<std::string, torch::Tensor>& b) {
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
