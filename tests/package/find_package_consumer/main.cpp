// Packaging test: a consumer declares an EMA in one line through an alias and updates it, in two
// translation units (second.cpp), as a trainer split into files would; with
// EMAKIT_CONSUMER_POSTHOC, a third (snapshots.cpp) uses the post-hoc part.
#include <emakit/emakit.hpp>
#include <torch/nn/modules/linear.h>
#include <fmt/core.h>

#include <unistd.h>

#include <filesystem>

emakit::UpdateResult update_elsewhere(emakit::WarmupEma& ema);  // second.cpp
int count_snapshots(const std::filesystem::path& folder);       // snapshots.cpp

int main() {
  torch::nn::Linear model(4, 2);
  emakit::WarmupEma ema(*model);  // alias: inverse-power warmup decay, flat storage
  torch::NoGradGuard no_grad;
  model->weight.add_(1.0);
  [[maybe_unused]] emakit::UpdateResult r = ema.update();
  model->weight.add_(1.0);
  update_elsewhere(ema);
  fmt::print("{}\n", ema);  // an fmt formatter exists for every Ema
#if defined(EMAKIT_CONSUMER_POSTHOC)
  const int snapshots =
      count_snapshots(std::filesystem::temp_directory_path() / fmt::format("emakit-consumer-phema-{}", ::getpid()));
  fmt::print("post-hoc part: {} snapshots\n", snapshots);
  if (snapshots != 4) return 1;
#endif
  return ema.num_updates() == 2 ? 0 : 1;
}
