// StepSchedule, call by call: both warmup conventions, update_every, accumulation windows, veto.
#include <emakit/decay.hpp>
#include <emakit/schedule.hpp>

#include <catch2/catch.hpp>

#include <set>
#include <string>

namespace test_schedule {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit::Action;
using emakit::StepSchedule;
using emakit::Warmup;

namespace {
// Runs `calls` calls through the schedule as an Ema would and returns one letter per call:
// S skipped, C copied, A averaged. `steps` receives the step of each call.
std::string trace(const StepSchedule& s, int calls, const std::set<int>& vetoed = {},
                  std::vector<std::int64_t>* steps = nullptr) {
  std::string out;
  std::int64_t num_updates = 0, previous = 0;
  for (int call = 1; call <= calls; ++call) {
    const auto d = s.decide({call, std::nullopt, previous, num_updates, vetoed.count(call) > 0});
    out += d.action == Action::skipped ? 'S' : d.action == Action::copied ? 'C' : 'A';
    if (d.action != Action::skipped) ++num_updates;
    previous = d.step;
    if (steps) steps->push_back(d.step);
  }
  return out;
}
}  // namespace

TEST_CASE("The default schedule averages at every step from the first", "[schedule]") {
  std::vector<std::int64_t> steps;
  CHECK(trace(StepSchedule(), 5, {}, &steps) == "AAAAA");
  CHECK(steps == std::vector<std::int64_t>{1, 2, 3, 4, 5});
}

TEST_CASE("Warmup::none skips steps before start_step and off the update_every grid", "[schedule]") {
  CHECK(trace(StepSchedule().start_step(3), 5) == "SSAAA");
  CHECK(trace(StepSchedule().update_every(2), 6) == "SASASA");
  CHECK(trace(StepSchedule().update_every(3).every_offset(1), 7) == "ASSASSA");
}

TEST_CASE("copy_before_start follows ema-pytorch: first update copies, then copies until start", "[schedule]") {
  // ema-pytorch with update_after_step = 3, update_every = 2: step_before % 2 == 0 is eligible,
  // step_before <= 3 copies. In emakit's terms: every_offset 1, start_step 3 + 2 = 5.
  auto s = StepSchedule().warmup(Warmup::copy_before_start).start_step(5).update_every(2).every_offset(1);
  CHECK(trace(s, 9) == "CSCSASASA");
  // The very first call copies even off the grid.
  auto off_grid = StepSchedule().warmup(Warmup::copy_before_start).update_every(4);
  CHECK(trace(off_grid, 8) == "CSSASSSA");
}

TEST_CASE("skip_before_start follows AveragedModel/EMAHook: nothing before start, first eligible copies",
          "[schedule]") {
  auto s = StepSchedule().warmup(Warmup::skip_before_start).start_step(3).update_every(2);
  CHECK(trace(s, 8) == "SSSCSASA");
  CHECK(trace(StepSchedule().warmup(Warmup::skip_before_start), 3) == "CAA");
}

TEST_CASE("A vetoed step never changes the average", "[schedule]") {
  std::vector<std::int64_t> steps;
  CHECK(trace(StepSchedule(), 4, {2, 3}, &steps) == "ASSA");
  CHECK(steps == std::vector<std::int64_t>{1, 1, 1, 2});  // a vetoed call completes no step
  // The first eligible update was vetoed: the copy moves to the next eligible one.
  CHECK(trace(StepSchedule().warmup(Warmup::skip_before_start), 3, {1}) == "SCA");
  CHECK(trace(StepSchedule().warmup(Warmup::copy_before_start), 3, {1}) == "SCA");
}

TEST_CASE("An accumulation window updates once per window, at its end or start", "[schedule]") {
  std::vector<std::int64_t> steps;
  CHECK(trace(StepSchedule().accumulate(3), 7, {}, &steps) == "SSASSAS");
  CHECK(steps == std::vector<std::int64_t>{0, 0, 1, 1, 1, 2, 2});
  steps.clear();
  CHECK(trace(StepSchedule().accumulate(3).window_edge(emakit::WindowEdge::start), 7, {}, &steps) == "ASSASSA");
  CHECK(steps == std::vector<std::int64_t>{1, 1, 1, 2, 2, 2, 3});
  // update_every counts optimizer steps, not micro-batches.
  CHECK(trace(StepSchedule().accumulate(2).update_every(2), 8) == "SSSASSSA");
}

TEST_CASE("A step supplied by the caller is the step", "[schedule]") {
  const auto d = StepSchedule().update_every(10).decide({1, 40, 0, 0, false});
  CHECK(d.step == 40);
  CHECK(d.action == Action::averaged);
  CHECK(StepSchedule().update_every(10).decide({2, 41, 40, 1, false}).action == Action::skipped);
}

TEST_CASE("Schedule options out of range are rejected with the value", "[schedule][errors]") {
  CHECK_THROWS_WITH(StepSchedule().update_every(0), Contains("StepSchedule::update_every must be > 0, got 0"));
  CHECK_THROWS_WITH(StepSchedule().update_every(-4), Contains("StepSchedule::update_every must be > 0, got -4"));
  CHECK_THROWS_WITH(StepSchedule().start_step(-1), Contains("StepSchedule::start_step must be >= 0, got -1"));
  CHECK_THROWS_WITH(StepSchedule().accumulate(0),
                    Contains("StepSchedule::accumulate (accumulation window) must be > 0, got 0"));
  CHECK_THROWS_WITH(StepSchedule().every_offset(-1), Contains("StepSchedule::every_offset must be >= 0, got -1"));
  CHECK_THROWS_AS(StepSchedule().warmup(static_cast<Warmup>(9)), std::invalid_argument);
}

namespace {
struct EveryOther {
  emakit::Decision decide(const emakit::ScheduleInput& in) const {
    return {in.call % 2 == 0 ? emakit::Action::averaged : emakit::Action::skipped, in.call};
  }
};
struct ReturnsBool {
  bool decide(const emakit::ScheduleInput&) const { return true; }
};
}  // namespace
static_assert(emakit::SchedulePolicy<StepSchedule>);
static_assert(emakit::SchedulePolicy<EveryOther>);
static_assert(!emakit::SchedulePolicy<ReturnsBool>);
static_assert(!emakit::SchedulePolicy<emakit::Fixed>);

}  // namespace test_schedule
