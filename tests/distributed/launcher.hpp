// Multi-process tests: the test executable starts its own rank processes.
//
// A Catch2 test case calls launch("case", world, ...): the executable re-executes itself once per
// rank as `emakit_distributed_tests --rank r --world n --store <dir>/store --case case [--dir d]
// [--arg a]`, with each rank's output in <dir>/rank-<r>.log, waits for all of them at most a
// deadline and kills the stragglers. The ranks meet through a c10d::FileStore in the folder and
// talk over Gloo on loopback. A rank case checks what it can itself and exits 0 when it passed.
#pragma once

#include "../../examples/subprocess.hpp"

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <fmt/format.h>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace emakit_dist {

// What the rank process of a case is told.
struct RankArgs {
  int rank = 0;
  int world = 1;
  std::string store;  // the FileStore's file
  std::string dir;    // a folder the case may use (checkpoints)
  std::string arg;    // a case-specific argument
};

// The rank cases, by name (registered by RANK_CASE).
inline std::map<std::string, std::function<int(const RankArgs&)>>& rank_cases() {
  static std::map<std::string, std::function<int(const RankArgs&)>> cases;
  return cases;
}
struct RankCaseRegistrar {
  RankCaseRegistrar(const char* name, std::function<int(const RankArgs&)> f) {
    rank_cases().emplace(name, std::move(f));
  }
};
#define EMAKIT_RANK_CASE_CAT2(a, b) a##b
#define EMAKIT_RANK_CASE_CAT(a, b) EMAKIT_RANK_CASE_CAT2(a, b)
#define RANK_CASE(name)                                                                     \
  static int EMAKIT_RANK_CASE_CAT(rank_case_, __LINE__)(const emakit_dist::RankArgs& args); \
  static emakit_dist::RankCaseRegistrar EMAKIT_RANK_CASE_CAT(rank_case_reg_, __LINE__)(     \
      name, EMAKIT_RANK_CASE_CAT(rank_case_, __LINE__));                                    \
  static int EMAKIT_RANK_CASE_CAT(rank_case_, __LINE__)(const emakit_dist::RankArgs& args)

// How one rank process ended.
struct RankEnd {
  int exit_code = -1;         // when it exited
  int signal = 0;             // when a signal ended it
  bool killed_by_us = false;  // still running at the deadline
  std::string log;
  bool passed() const { return signal == 0 && !killed_by_us && exit_code == 0; }
};

struct Launch {
  std::vector<RankEnd> ranks;
  double seconds = 0;
  std::string describe() const {
    std::string s;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      const auto& e = ranks[r];
      s += "---- rank " + std::to_string(r) + ": " +
           (e.killed_by_us ? std::string("killed at the deadline")
            : e.signal     ? "signal " + std::to_string(e.signal)
                           : "exit " + std::to_string(e.exit_code)) +
           "\n" + e.log + "\n";
    }
    return s;
  }
};

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Starts `world` rank processes of case `name` and waits for them at most `deadline_s` seconds;
// the ones still running then are SIGKILLed (RankEnd::killed_by_us).
inline Launch launch(const std::string& name, int world, const std::filesystem::path& dir, double deadline_s = 60,
                     const std::string& arg = "", const std::string& work_dir = "") {
  std::filesystem::create_directories(dir);
  const std::string store = (dir / fmt::format("store-{}-{}", name, world)).string();
  std::filesystem::remove(store);
  std::vector<emakit_subprocess::Process> ranks;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < world; ++r) {
    const std::string log = (dir / fmt::format("{}-{}-rank-{}.log", name, world, r)).string();
    ranks.emplace_back(std::vector<std::string>{"/proc/self/exe", "--rank", std::to_string(r), "--world",
                                                std::to_string(world), "--store", store, "--case", name, "--dir",
                                                work_dir.empty() ? dir.string() : work_dir, "--arg", arg},
                       emakit_subprocess::Options{.output = log});
  }
  Launch out;
  out.ranks.resize(static_cast<std::size_t>(world));
  std::vector<bool> done(static_cast<std::size_t>(world), false);
  int remaining = world;
  while (remaining > 0) {
    for (int r = 0; r < world; ++r) {
      if (done[static_cast<std::size_t>(r)]) continue;
      if (const auto status = ranks[static_cast<std::size_t>(r)].try_wait()) {
        done[static_cast<std::size_t>(r)] = true;
        --remaining;
        auto& e = out.ranks[static_cast<std::size_t>(r)];
        if (WIFEXITED(*status)) e.exit_code = WEXITSTATUS(*status);
        if (WIFSIGNALED(*status)) e.signal = WTERMSIG(*status);
      }
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (remaining > 0 && elapsed > deadline_s) {
      for (int r = 0; r < world; ++r) {
        if (done[static_cast<std::size_t>(r)]) continue;
        ranks[static_cast<std::size_t>(r)].signal(SIGKILL);
        ranks[static_cast<std::size_t>(r)].wait();
        out.ranks[static_cast<std::size_t>(r)].killed_by_us = true;
        done[static_cast<std::size_t>(r)] = true;
      }
      remaining = 0;
    }
    if (remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < world; ++r)
    out.ranks[static_cast<std::size_t>(r)].log = read_file(dir / fmt::format("{}-{}-rank-{}.log", name, world, r));
  return out;
}

// Parses the rank arguments; false when argv is not a rank command line.
inline bool parse_rank_args(int argc, char** argv, RankArgs& a, std::string& name) {
  bool is_rank = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rank") {
      a.rank = std::stoi(v);
      is_rank = true;
    } else if (k == "--world") {
      a.world = std::stoi(v);
    } else if (k == "--store") {
      a.store = v;
    } else if (k == "--case") {
      name = v;
    } else if (k == "--dir") {
      a.dir = v;
    } else if (k == "--arg") {
      a.arg = v;
    }
  }
  return is_rank;
}

}  // namespace emakit_dist
