// Mode mixing (tests/CMakeLists.txt): a default-mode program that includes a part with a file of
// its own (<emakit/posthoc.hpp>, implementation/posthoc.hpp). Linked with the core's
// implementation alone it must fail on the part's link check, the name that says what to do
// (compile_fail.mode_mix_missing_part); with the part's file too it links and runs
// (compile_fail.mode_mix_control_part).
#include <emakit/posthoc.hpp>

#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

int main() {
  const auto folder = std::filesystem::temp_directory_path() /
                      ("emakit-mode-mix-posthoc-" + std::to_string(static_cast<long>(std::rand())));
  std::filesystem::remove_all(folder);
  torch::nn::Linear model(4, 2);
  {
    emakit::PostHocEma posthoc(*model, emakit::PostHocOptions(folder).sigma_rels({0.05, 0.10}).snapshot_every(2));
    for (int step = 0; step < 4; ++step) posthoc.update();
  }
  const auto snapshots = emakit::list_snapshots(folder);
  std::filesystem::remove_all(folder);
  if (snapshots.size() != 4) {
    std::fprintf(stderr, "mode_mix: 4 updates of 2 profiles every 2 steps wrote %zu snapshots, expected 4\n",
                 snapshots.size());
    return 1;
  }
  std::puts("mode_mix: the post-hoc part linked and wrote 4 snapshots");
  return 0;
}
