// The main of emakit_distributed_tests: a Catch2 runner, or one rank process of a test
// (argv: --rank r --world n --store file --case name ...; see launcher.hpp).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "../skip.hpp"
#include "launcher.hpp"

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

int main(int argc, char** argv) {
  emakit_dist::RankArgs args;
  std::string name;
  if (emakit_dist::parse_rank_args(argc, argv, args, name)) {
    int code = 1;
    auto it = emakit_dist::rank_cases().find(name);
    if (it == emakit_dist::rank_cases().end()) {
      std::fprintf(stderr, "no rank case '%s'\n", name.c_str());
    } else {
      try {
        code = it->second(args);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: uncaught exception: %s\n", args.rank, e.what());
        code = 2;
      }
    }
    std::fflush(stdout);
    std::fflush(stderr);
    // No destructors: a process group whose peers are gone may wait in its destructor.
    std::_Exit(code);
  }
#if !EMAKIT_HAVE_GLOO
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing = listing || std::strncmp(argv[i], "--list", 6) == 0;
  if (!listing) {
    std::puts("SKIPPED: emakit_distributed_tests was built without the Gloo headers (gloo/algorithm.h); install "
              "libgloo-dev and reconfigure");
    return 77;
  }
#endif
  // 0, 1 when anything failed, or EMAKIT_SKIP_EXIT when a test case was skipped (tests/skip.hpp).
  return emakit_test::exit_status(Catch::Session().run(argc, argv));
}
