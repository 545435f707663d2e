// The consumer's third translation unit: it includes the post-hoc EMA, a part of emakit with a
// file of its own, so the program links emakit::posthoc (in the default mode: emakit::emakit plus
// share/emakit/posthoc.cpp; cmake/emakit_check_consumer.cmake finds PostHocEma's code once, in that
// file's object).
#include <emakit/posthoc.hpp>

#include <torch/nn/modules/linear.h>

#include <filesystem>

// Tracks two profiles over four updates with a snapshot every two, and returns how many snapshot
// files the folder holds afterwards (four).
int count_snapshots(const std::filesystem::path& folder) {
  std::filesystem::remove_all(folder);
  torch::nn::Linear model(4, 2);
  {
    emakit::PostHocEma posthoc(*model, emakit::PostHocOptions(folder).sigma_rels({0.05, 0.10}).snapshot_every(2));
    for (int step = 0; step < 4; ++step) posthoc.update();
  }
  const auto count = static_cast<int>(emakit::list_snapshots(folder).size());
  std::filesystem::remove_all(folder);
  return count;
}
