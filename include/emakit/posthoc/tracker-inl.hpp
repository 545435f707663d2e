// The non-template definitions of tracker.hpp: included at the end of tracker.hpp in the all-inline
// mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/posthoc/tracker-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/posthoc/tracker.hpp> instead"
#endif

#include <emakit/posthoc/tracker.hpp>
#include <emakit/detail/serial/posix_file.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC PostHocUpdate PostHocEma::update(StepInfo info) {
  if (!folder_checked_) check_folder();
  // Every profile in one pass over the model (an EmaGroup: bitwise each one's update()).
  if (!group_) group_.emplace(std::span<Tracked>(emas_));
  const UpdateResult first = group_->update(info).front();
  PostHocUpdate out{first.action, first.step, false};
  const auto every = options_.snapshot_every();
  if (every > 0 && first.step > 0 && first.step % every == 0 && emas_.front().num_updates() > 0 &&
      first.step != last_snapshot_step_) {
    snapshot();
    out.snapshot = true;
  }
  return out;
}

EMAKIT_FUNC std::vector<std::filesystem::path> PostHocEma::snapshot() {
  const Tracked& lead = emas_.front();
  if (lead.num_updates() == 0)
    detail::fail("PostHocEma::snapshot() before the first update: no EMA has been updated yet (updates happen at "
                 "steps that are multiples of update_every = {})",
                 options_.update_every());
  if (!folder_checked_) check_folder();
  // The chain of the run's snapshot steps: a second snapshot at the same step rewrites that one.
  const std::int64_t previous =
      lead.step() == last_snapshot_step_ ? previous_snapshot_step_ : std::max<std::int64_t>(last_snapshot_step_, 0);
  std::vector<std::filesystem::path> files;
  for (std::size_t i = 0; i < emas_.size(); ++i) {
    const Tracked& ema = emas_[i];
    SnapshotInfo header;
    header.step = ema.step();
    header.t = ema.last_update_step();
    header.gamma = ema.decay_policy().gamma();
    header.sigma_rel = ema.decay_policy().sigma_rel();
    header.update_every = options_.update_every();
    header.profile = static_cast<std::uint32_t>(i);
    header.profiles = static_cast<std::uint32_t>(emas_.size());
    header.run = run_;
    header.run_started = run_started_;
    header.previous_step = previous;
    const StateDict tensors = ema.averages();
    const auto averaged = ema.names(Role::average);  // copy_only names and integer buffers are copied
    for (const auto& item : tensors) {
      const bool is_averaged = std::find(averaged.begin(), averaged.end(), item.key()) != averaged.end();
      header.tensors.push_back(
          detail::snapshot_entry(item.key(), item.value(), is_averaged, options_.snapshot_dtype()));
    }
    const auto path = options_.folder() / snapshot_file_name(header.step, header.profile);
    write_snapshot(path, std::move(header), tensors);
    files.push_back(path);
  }
  previous_snapshot_step_ = previous;
  last_snapshot_step_ = lead.step();
  return files;
}

EMAKIT_FUNC StateDict PostHocEma::state_dict() const {
  StateDict out;
  out.insert("posthoc.format", at::scalar_tensor(detail::formats::posthoc_state.version, at::kLong));
  out.insert("posthoc.profiles", at::scalar_tensor(static_cast<std::int64_t>(emas_.size()), at::kLong));
  out.insert("posthoc.snapshot_every", at::scalar_tensor(options_.snapshot_every(), at::kLong));
  out.insert("posthoc.last_snapshot_step", at::scalar_tensor(last_snapshot_step_, at::kLong));
  out.insert("posthoc.previous_snapshot_step", at::scalar_tensor(previous_snapshot_step_, at::kLong));
  at::Tensor run = at::empty({static_cast<std::int64_t>(run_.bytes.size())}, at::TensorOptions().dtype(at::kByte));
  std::copy(run_.bytes.begin(), run_.bytes.end(), run.data_ptr<std::uint8_t>());
  out.insert("posthoc.run_id", run);
  out.insert("posthoc.run_started", at::scalar_tensor(run_started_, at::kLong));
  for (std::size_t i = 0; i < emas_.size(); ++i)
    for (const auto& item : emas_[i].state_dict())
      out.insert(fmt::format("profile.{}.{}", i, item.key()), item.value());
  return out;
}

EMAKIT_FUNC void PostHocEma::load_state_dict(const StateDict& state) {
  const detail::StateReader in(state, "PostHocEma::load_state_dict");
  if (in.find("posthoc.format") == nullptr)
    detail::fail("PostHocEma::load_state_dict: the state has no 'posthoc.format': it is not a PostHocEma's "
                 "state_dict(){}",
                 in.find(std::string(detail::ema_state::calls_key)) != nullptr ? " (it is an Ema's)" : "");
  const std::int64_t format = in.counter("posthoc.format");
  detail::formats::check_version(detail::formats::posthoc_state, format, "PostHocEma::load_state_dict");
  const std::int64_t profiles = in.counter("posthoc.profiles");
  if (profiles != static_cast<std::int64_t>(emas_.size()))
    detail::fail("PostHocEma::load_state_dict: the state has {} profiles, this PostHocEma {}", profiles, emas_.size());
  const std::int64_t snapshot_every = in.counter("posthoc.snapshot_every");
  if (snapshot_every != options_.snapshot_every())
    detail::fail("PostHocEma::load_state_dict: snapshot_every is {} in the state, {} here", snapshot_every,
                 options_.snapshot_every());
  const auto last_snapshot = in.optional_integer("posthoc.last_snapshot_step");  // -1: none yet
  if (!last_snapshot || *last_snapshot < -1)
    detail::fail("PostHocEma::load_state_dict: 'posthoc.last_snapshot_step' must be an integer >= -1 (-1: no "
                 "snapshot yet), got {}",
                 last_snapshot ? std::to_string(*last_snapshot) : std::string("nothing"));
  const std::int64_t last_snapshot_step = *last_snapshot;
  RunId run;  // format 1: no run recorded, as in that run's snapshots
  std::int64_t run_started = 0, previous_snapshot_step = -1;
  if (format >= 2) {
    const at::Tensor* id = in.find("posthoc.run_id");
    if (id == nullptr || id->scalar_type() != at::kByte || id->dim() != 1 ||
        id->numel() != static_cast<std::int64_t>(run.bytes.size()))
      detail::fail("PostHocEma::load_state_dict: 'posthoc.run_id' must be 16 uint8, got {}",
                   id == nullptr ? std::string("nothing")
                                 : fmt::format("a {} tensor of shape {}", c10::toString(id->scalar_type()),
                                               detail::shape_string(id->sizes())));
    const at::Tensor bytes = id->contiguous();
    std::copy_n(bytes.data_ptr<std::uint8_t>(), run.bytes.size(), run.bytes.begin());
    run_started = in.counter("posthoc.run_started");
    const auto previous = in.optional_integer("posthoc.previous_snapshot_step");
    if (!previous || *previous < -1)
      detail::fail("PostHocEma::load_state_dict: 'posthoc.previous_snapshot_step' must be an integer >= -1");
    previous_snapshot_step = *previous;
  }
  std::vector<StateDict> parts(emas_.size());
  for (const auto& item : state) {
    const auto& key = item.key();
    if (key.rfind("posthoc.", 0) == 0) continue;
    std::size_t i = 0, used = 0;
    if (key.rfind("profile.", 0) == 0) i = std::stoul(key.substr(8), &used);
    if (used == 0 || i >= emas_.size() || key.size() <= 8 + used || key[8 + used] != '.')
      detail::fail("PostHocEma::load_state_dict: unexpected key '{}'", key);
    parts[i].insert(key.substr(9 + used), item.value());
  }
  for (std::size_t i = 0; i < emas_.size(); ++i) check_loadable(i, parts[i]);
  for (std::size_t i = 0; i < emas_.size(); ++i) emas_[i].load_state_dict(parts[i]);
  last_snapshot_step_ = last_snapshot_step;
  previous_snapshot_step_ = previous_snapshot_step;
  run_ = run;
  run_started_ = run_started;
  folder_checked_ = false;  // the folder is checked again for this run
}

namespace detail {
// Moves `files` into a new folder "<folder>/<name>" ("<name>-2", ... if taken); returns it.
EMAKIT_FUNC std::filesystem::path move_into_new_folder(const std::filesystem::path& folder, const std::string& name,
                                                       const std::vector<SnapshotInfo>& files,
                                                       const std::string& whose) {
  std::filesystem::path aside = folder / name;
  for (int n = 2; std::filesystem::exists(aside); ++n) aside = folder / fmt::format("{}-{}", name, n);
  std::error_code ec;
  std::filesystem::create_directory(aside, ec);
  if (ec) detail::fail_runtime("cannot create '{}' to move {} into: {}", aside.string(), whose, ec.message());
  for (const auto& s : files) {
    std::filesystem::rename(s.path, aside / s.path.filename(), ec);
    if (ec)
      detail::fail_runtime("cannot move '{}' into '{}' (moving {} there): {}", s.path.string(), aside.string(), whose,
                           ec.message());
  }
  detail::fsync_directory(aside);
  return aside;
}
}  // namespace detail

EMAKIT_FUNC void PostHocEma::check_folder() {
  const auto& folder = options_.folder();
  // Another run's snapshots, and this run's after the step it goes on from: those a run resumed
  // from an older checkpoint wrote before (a crash after step 500, resumed from the state of step
  // 300): another history of this run, which a synthesis must not mix with this one.
  std::vector<SnapshotInfo> others, abandoned;
  const std::int64_t from = step();
  for (auto& s : list_snapshots(folder)) {
    if (s.run != run_) {
      others.push_back(std::move(s));
    } else if (s.step > from) {
      abandoned.push_back(std::move(s));
    }
  }
  const auto runs = snapshot_runs(others);
  if (!others.empty() && options_.existing_snapshots() == ExistingSnapshots::refuse) {
    std::string which;
    for (const auto& r : runs) which += fmt::format("\n  - {}", r.describe());
    detail::fail_runtime(
        "the snapshot folder '{}' holds the snapshots of another training run:{}\nThis PostHocEma is run {}; a "
        "synthesis from a folder of two runs would mix them. To continue that run, load its state "
        "(PostHocEma::load_state_dict) before the first update; to start a new run here, set "
        "PostHocOptions::existing_snapshots(ExistingSnapshots::move_aside), which moves them into "
        "'{}/previous-run-<id>'; or give this run another folder",
        folder.string(), which, run_.short_hex(), folder.string());
  }
  for (const auto& r : runs) {
    std::vector<SnapshotInfo> of_run;
    for (const auto& s : others)
      if (s.run == r.id) of_run.push_back(s);
    detail::move_into_new_folder(folder, fmt::format("previous-run-{}", r.id.short_hex()), of_run,
                                 fmt::format("the snapshots of run {}", r.id.short_hex()));
  }
  if (!abandoned.empty()) {  // always set aside, never deleted: this run's own files
    const SnapshotRun branch = snapshot_runs(abandoned).front();
    const auto aside =
        detail::move_into_new_folder(folder, fmt::format("abandoned-{}-after-{}", run_.short_hex(), from), abandoned,
                                     fmt::format("the snapshots of run {} after step {}", run_.short_hex(), from));
    TORCH_WARN("emakit: PostHocEma: run ", run_.short_hex(), " goes on from step ", from, ", but the folder held ",
               branch.snapshots, " of its snapshots from after that step (t = ", branch.first_t, " to ", branch.last_t,
               "): another history of the run (one resumed from an older checkpoint), which a "
               "synthesis must not mix with this one; moved them into '",
               aside.string(), "'");
  }
  if (!others.empty() || !abandoned.empty()) detail::fsync_directory(folder);
  folder_checked_ = true;
}

EMAKIT_FUNC void PostHocEma::prepare() {
  const auto every = options_.snapshot_every(), dt = options_.update_every();
  if (every > 0 && every % dt != 0)
    detail::fail("PostHocOptions: snapshot_every ({}) must be a multiple of update_every ({}), so that each "
                 "snapshot is taken right after an update",
                 every, dt);
  run_started_ =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::error_code ec;
  std::filesystem::create_directories(options_.folder(), ec);
  if (ec) detail::fail_runtime("cannot create the snapshot folder '{}': {}", options_.folder().string(), ec.message());
  detail::check_writable_folder(options_.folder());
}

EMAKIT_FUNC void PostHocEma::check_loadable(std::size_t i, const StateDict& part) const {
  try {
    emas_[i].check_state_dict(part, LoadMode::strict);
  } catch (const std::invalid_argument&) {
    detail::rethrow_with_context(" (the profiles or the model changed)",
                                 fmt::format("PostHocEma::load_state_dict: profile {}: ", i));
  }
}

EMAKIT_FUNC void save(const PostHocEma& posthoc, const std::filesystem::path& path) {
  detail::save_state_file(posthoc.state_dict(), path);
}

EMAKIT_FUNC void load(PostHocEma& posthoc, const std::filesystem::path& path) {
  detail::load_state_file(path, [&](const StateDict& state) { posthoc.load_state_dict(state); });
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
