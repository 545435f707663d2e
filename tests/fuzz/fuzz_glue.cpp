// The loading half of the fuzz target (fuzz_checkpoint.cpp has the why): what emakit does with
// bytes its archive check accepted, the snapshot reader, and the seed corpus. Built with g++, not
// instrumented.
#include <emakit/aliases.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/detail/serial/archive_file.hpp>
#include <emakit/detail/serial/archive_scan.hpp>
#include <emakit/detail/serial/checksum.hpp>
#include <emakit/detail/serial/snapshot_file.hpp>
#include <emakit/hooks.hpp>

#include <c10/core/CPUAllocator.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc = register_module("fc", torch::nn::Linear(3, 2));
    register_buffer("steps", torch::zeros({1}, torch::kLong));
  }
  torch::nn::Linear fc{nullptr};
};

std::string bytes_of(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void make_corpus(const std::filesystem::path& folder) {
  std::filesystem::create_directories(folder);
  torch::manual_seed(0);
  Net net;
  emakit::FixedEma ema(net, emakit::Fixed(0.5));
  ema.update();
  torch::serialize::OutputArchive a;
  ema.save(a);
  const std::string ema_file = bytes_of(a);

  emakit::EmaHook hook;
  hook.add(net, emakit::Recipe(emakit::Fixed(0.5)));
  hook.setup();
  hook.after_optimizer_step({});
  torch::serialize::OutputArchive h;
  hook.save_checkpoint(h);
  const std::string hook_file = bytes_of(h);

  int n = 0;
  // The pickles of torch.save files (Python's, in the repository; LibTorch's write_tensor_dict),
  // OrderedDicts at the root and inside (Lightning's), for the pickle reader.
  const std::filesystem::path source(EMAKIT_FUZZ_SOURCE_DIR);
  for (const auto* fixtures : {"tests/conformance/fixtures/roundtrip", "tests/fixtures/posthoc_v1"})
    for (const auto& entry : std::filesystem::directory_iterator(source / fixtures)) {
      if (entry.path().extension() != ".pt") continue;
      caffe2::serialize::PyTorchStreamReader zip(entry.path().string());
      const auto [data, size] = zip.getRecord("data.pkl");
      write(folder / ("pickle-" + std::to_string(n++)), std::string(static_cast<const char*>(data.get()), size));
    }
  // Snapshots: format 1 (the repository's fixtures) and 2 (written here), for the snapshot reader.
  for (const auto& entry : std::filesystem::directory_iterator(source / "tests/fixtures/posthoc_v1"))
    if (entry.path().extension() == ".emkit")
      std::filesystem::copy_file(entry.path(), folder / ("snapshot-" + std::to_string(n++)),
                                 std::filesystem::copy_options::overwrite_existing);
  emakit::SnapshotInfo info{.step = 7, .t = 6, .gamma = 6.9, .sigma_rel = 0.05, .previous_step = 3};
  for (const auto& item : net.named_parameters())
    info.tensors.push_back({.name = item.key(), .sizes = item.value().sizes().vec()});
  info.tensors.push_back(
      {.name = "steps", .stored_dtype = c10::kLong, .dtype = c10::kLong, .averaged = false, .sizes = {1}});
  {
    emakit::detail::SnapshotWriter writer(folder / ("snapshot-" + std::to_string(n++)), info);
    std::size_t i = 0;
    for (const auto& item : net.named_parameters()) writer.write(i++, item.value());
    writer.write(i, torch::zeros({1}, torch::kLong));
    writer.commit();
  }
  for (const std::string* good : {&ema_file, &hook_file}) {
    write(folder / ("valid-" + std::to_string(n++)), *good);
    for (std::size_t cut : {good->size() / 2, good->size() - 22, std::size_t{64}})  // truncated
      write(folder / ("cut-" + std::to_string(n++)), good->substr(0, cut));
    for (std::size_t at = 64; at < good->size(); at += good->size() / 8) {  // a byte flipped
      std::string flipped = *good;
      flipped[at] = static_cast<char>(flipped[at] ^ 0x5a);
      write(folder / ("flip-" + std::to_string(n++)), flipped);
    }
  }
  std::printf("emakit fuzz: wrote %d seed files to %s\n", n, folder.c_str());
}

}  // namespace

// Valid files (emakit::save / torch::save(ema), hook checkpoints, torch.save pickles, snapshots)
// and broken ones (cut short, bytes flipped).
void emakit_fuzz_make_corpus(const char* folder) { make_corpus(folder); }

// What read_pickle_dict does with the values the checker gave: the dict built from them, here
// with every data/<n> record 256 bytes long (the check held each storage to that).
void emakit_fuzz_build_dict(const emakit::detail::archive_scan::PickleValues& values) {
  try {
    (void)emakit::detail::build_pickle_dict(values, [](const std::string&) {
      return std::make_tuple(c10::GetCPUAllocator()->allocate(256), std::size_t{256});
    });
  } catch (const std::exception&) {
  }
}

// A snapshot file of these bytes, its header's CRC-32 made right (libFuzzer cannot find one), read
// as SnapshotReader reads it: the header, then each tensor.
void emakit_fuzz_snapshot(const char* data, std::size_t size) {
  std::string bytes(data, size);
  std::uint32_t header = 0;
  if (size >= 16) std::memcpy(&header, data + 12, 4);
  if (size >= 20 && header <= size - 20) {
    const std::uint32_t crc = emakit::detail::crc32(bytes.data(), 16 + std::size_t{header});
    std::memcpy(bytes.data() + 16 + header, &crc, 4);
  }
  const int fd = ::memfd_create("emakit-fuzz-snapshot", MFD_CLOEXEC);
  if (fd < 0 || ::write(fd, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) std::abort();
  try {
    const emakit::detail::SnapshotReader reader("/proc/self/fd/" + std::to_string(fd));
    for (std::size_t i = 0; i < reader.info().tensors.size(); ++i) (void)reader.read(i);
  } catch (const std::exception&) {
  }
  ::close(fd);
}

// LibTorch may still find an accepted file wrong (a bad zip record, a type mismatch) and
// emakit's checks may refuse it; both throw std::exception, never crash.
void emakit_fuzz_load(const char* data, std::size_t size) {
  static Net net;
  static emakit::FixedEma ema(net, emakit::Fixed(0.5));
  static emakit::EmaHook* hook = [] {
    auto* h = new emakit::EmaHook;  // lives for the process, as `net` does
    h->add(net, emakit::Recipe(emakit::Fixed(0.5)));
    h->setup();
    return h;
  }();
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(data, size);
    try {
      ema.load(archive);
    } catch (const std::exception&) {
    }
    hook->load_checkpoint(archive);
  } catch (const std::exception&) {
  }
}
