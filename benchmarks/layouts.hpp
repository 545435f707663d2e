// Model layouts the benchmarks update: lists of tensor shapes with the parameter shapes of real
// models (no buffers, so every implementation updates the same tensors). The Python peers read
// the same lists: `emakit_bench_ema_update --emakit_dump_layouts=FILE` writes them as JSON.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace emakit_bench {

using Shape = std::vector<std::int64_t>;

struct Layout {
  std::string name;
  std::string description;
  std::vector<Shape> shapes;

  std::int64_t numel() const {
    std::int64_t total = 0;
    for (const auto& s : shapes) {
      std::int64_t n = 1;
      for (auto d : s) n *= d;
      total += n;
    }
    return total;
  }
};

// torchvision resnet50: 161 parameter tensors, 25,557,032 parameters.
inline Layout resnet50() {
  Layout l{"resnet50", "ResNet-50 parameters", {}};
  auto conv_bn = [&](std::int64_t out, std::int64_t in, std::int64_t k) {
    l.shapes.push_back({out, in, k, k});
    l.shapes.push_back({out});
    l.shapes.push_back({out});
  };
  conv_bn(64, 3, 7);
  std::int64_t in = 64;
  const std::int64_t blocks[] = {3, 4, 6, 3};
  const std::int64_t widths[] = {64, 128, 256, 512};
  for (int stage = 0; stage < 4; ++stage) {
    for (std::int64_t b = 0; b < blocks[stage]; ++b) {
      const std::int64_t w = widths[stage];
      conv_bn(w, in, 1);
      conv_bn(w, w, 3);
      conv_bn(w * 4, w, 1);
      if (b == 0) conv_bn(w * 4, in, 1);  // downsample
      in = w * 4;
    }
  }
  l.shapes.push_back({1000, 2048});
  l.shapes.push_back({1000});
  return l;
}

// timm vit_base_patch16_224: 152 parameter tensors, 86,567,656 parameters.
inline Layout vit_b16() {
  Layout l{"vit_b16", "ViT-B/16 parameters", {}};
  const std::int64_t d = 768;
  l.shapes = {{1, 1, d}, {1, 197, d}, {d, 3, 16, 16}, {d}};
  for (int block = 0; block < 12; ++block) {
    const std::vector<Shape> b = {{d}, {d}, {3 * d, d}, {3 * d}, {d, d},     {d},
                                  {d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}};
    l.shapes.insert(l.shapes.end(), b.begin(), b.end());
  }
  l.shapes.push_back({d});
  l.shapes.push_back({d});
  l.shapes.push_back({1000, d});
  l.shapes.push_back({1000});
  return l;
}

// Many small tensors: 500 blocks of {32x64 weight, 32 bias, 64 norm weight, 64 norm bias}:
// 2,000 tensors, 1,104,000 parameters (per-tensor overhead dominates).
inline Layout many_small() {
  Layout l{"many_small", "2000 small tensors", {}};
  for (int block = 0; block < 500; ++block) {
    l.shapes.push_back({32, 64});
    l.shapes.push_back({32});
    l.shapes.push_back({64});
    l.shapes.push_back({64});
  }
  return l;
}

// One large tensor of n elements.
inline Layout large(std::int64_t n, const std::string& name) { return Layout{name, "one tensor", {{n}}}; }

// A LLaMA-like 1B-parameter layout (d 2048, 18 layers, MLP 5632, vocabulary 32000, tied
// embedding): 164 tensors, 991,086,592 parameters. For the GPU runs.
inline Layout llm1b() {
  Layout l{"llm1b", "1B-parameter LLM", {}};
  const std::int64_t d = 2048, f = 5632;
  l.shapes.push_back({32000, d});
  for (int layer = 0; layer < 18; ++layer) {
    const std::vector<Shape> b = {{d}, {d, d}, {d, d}, {d, d}, {d, d}, {d}, {f, d}, {f, d}, {d, f}};
    l.shapes.insert(l.shapes.end(), b.begin(), b.end());
  }
  l.shapes.push_back({d});
  return l;
}

// Every layout by name, in order of size.
inline std::vector<Layout> all_layouts() {
  return {
      many_small(), large(std::int64_t{1} << 24, "large_16m"),  resnet50(), large(std::int64_t{1} << 26, "large_64m"),
      vit_b16(),    large(std::int64_t{1} << 28, "large_256m"), llm1b()};
}

}  // namespace emakit_bench
