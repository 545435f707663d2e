// The non-template definitions of atomic_file.hpp: included at the end of
// atomic_file.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/atomic_file-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/atomic_file.hpp> instead"
#endif

#include <emakit/detail/serial/atomic_file.hpp>
#include <emakit/detail/serial/posix_file.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <emakit/detail/errors.hpp>

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC bool is_temporary_name(std::string_view filename) {
  return !filename.empty() && filename.front() == '.' && filename.find(".tmp-") != std::string_view::npos;
}

EMAKIT_FUNC void write_file_atomically(const std::filesystem::path& target, std::span<const char> bytes) {
  AtomicFile file(target);
  file.write(bytes.data(), bytes.size());
  file.commit();
}

EMAKIT_FUNC std::vector<char> read_file_bytes(const std::filesystem::path& path, std::string_view what) {
  const FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) fail_runtime("{}: cannot open '{}': {}", what, path.string(), errno_text(errno));
  struct ::stat info {};
  if (::fstat(fd.get(), &info) != 0) fail_runtime("{}: cannot read '{}': {}", what, path.string(), errno_text(errno));
  if (!S_ISREG(info.st_mode)) fail_runtime("{}: '{}' is not a regular file", what, path.string());
  std::vector<char> bytes(static_cast<std::size_t>(info.st_size));
  char past_end = 0;
  if (read_at(fd.get(), 0, bytes.data(), bytes.size(), path) != bytes.size() ||
      read_at(fd.get(), bytes.size(), &past_end, 1, path) != 0)
    fail_runtime("{}: '{}' changed size while it was read ({} bytes when opened)", what, path.string(), bytes.size());
  return bytes;
}

EMAKIT_FUNC void check_writable_folder(const std::filesystem::path& folder, const std::filesystem::path& target) {
  static std::atomic<std::uint64_t> counter{0};
  const auto probe_path =
      folder / fmt::format(".emakit-write-probe.tmp-{}-{}", static_cast<long>(::getpid()), counter++);
  const FileDescriptor probe(::open(probe_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!probe) {
    const int error = errno;
    if (target.empty())
      fail_runtime("the folder '{}' is not writable: cannot create a file in it: {}", folder.string(),
                   errno_text(error));
    fail_runtime("cannot write '{}': cannot create a file in '{}': {}", target.string(), folder.string(),
                 errno_text(error));
  }
  ::unlink(probe_path.c_str());
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
