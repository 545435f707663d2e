// FileDescriptor, AtomicFile and the POSIX reads and syncs under the file formats (atomic_file.hpp
// says what AtomicFile guarantees). Used only by the definitions of the file formats, in the
// implementation files of every part that writes or reads a file (implementation/*.hpp), or
// inline everywhere in the all-inline mode: a user's translation unit never parses <fcntl.h> and
// <unistd.h> for emakit.
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/posix_file.hpp is part of emakit's compiled code (emakit/implementation.hpp): include <emakit/detail/serial/atomic_file.hpp> instead"
#endif

#include <emakit/detail/config.hpp>
#include <emakit/detail/errors.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <utility>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// A file descriptor closed by its destructor.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) noexcept : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~FileDescriptor() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  // Closes and reports the error of close() (a deferred write error on some file systems).
  int close() noexcept {
    if (fd_ < 0) return 0;
    const int rc = ::close(std::exchange(fd_, -1));
    return rc == 0 ? 0 : errno;
  }
  void reset() noexcept { (void)close(); }

 private:
  int fd_ = -1;
};

// Reads exactly n bytes at offset; returns the number read (less only at the end of the file).
inline std::size_t read_at(int fd, std::uint64_t offset, void* data, std::size_t n, const std::filesystem::path& path) {
  auto* p = static_cast<char*>(data);
  std::size_t done = 0;
  while (done < n) {
    const ::ssize_t got = ::pread(fd, p + done, n - done, static_cast<::off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail_runtime("cannot read '{}': {}", path.string(), errno_text(errno));
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return done;
}

// fsync() a folder, so that a rename or a new name in it survives a power loss.
inline void fsync_directory(const std::filesystem::path& dir) {
  FileDescriptor fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) fail_runtime("cannot open the folder '{}' to sync it: {}", dir.string(), errno_text(errno));
  if (::fsync(fd.get()) != 0 && errno != EINVAL)  // EINVAL: a file system that cannot sync folders
    fail_runtime("cannot sync the folder '{}': {}", dir.string(), errno_text(errno));
}

class AtomicFile {
 public:
  // Creates the temporary file beside `target`. The folder must exist.
  explicit AtomicFile(std::filesystem::path target) : target_(std::move(target)) {
    if (target_.filename().empty()) fail_runtime("'{}' is a folder, not a file name", target_.string());
    static std::atomic<std::uint64_t> counter{0};
    temp_ = target_.parent_path() /
            fmt::format(".{}.tmp-{}-{}", target_.filename().string(), static_cast<long>(::getpid()), counter++);
    fd_ = FileDescriptor(::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (!fd_)
      fail_runtime("cannot write '{}': cannot create the temporary file '{}': {}", target_.string(), temp_.string(),
                   errno_text(errno));
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() { discard(); }

  const std::filesystem::path& target() const noexcept { return target_; }
  const std::filesystem::path& temp_path() const noexcept { return temp_; }

  // Appends n bytes.
  void write(const void* data, std::size_t n) {
    write_at(position_, data, n);
    position_ += n;
  }

  // Writes n bytes at offset (does not move the append position).
  void write_at(std::uint64_t offset, const void* data, std::size_t n) {
    ensure_open("write");
    const auto* p = static_cast<const char*>(data);
    std::size_t done = 0;
    while (done < n) {
      const ::ssize_t put = ::pwrite(fd_.get(), p + done, n - done, static_cast<::off_t>(offset + done));
      if (put < 0) {
        if (errno == EINTR) continue;
        fail_runtime("cannot write '{}' (temporary file '{}'): {}", target_.string(), temp_.string(),
                     errno_text(errno));
      }
      done += static_cast<std::size_t>(put);
    }
  }

  // Sets the file's size (the gap reads as zeros).
  void resize(std::uint64_t size) {
    ensure_open("resize");
    if (::ftruncate(fd_.get(), static_cast<::off_t>(size)) != 0)
      fail_runtime("cannot size '{}' (temporary file '{}') to {} bytes: {}", target_.string(), temp_.string(), size,
                   errno_text(errno));
  }

  // Makes the file durable and gives it the target name, replacing any file there.
  void commit() {
    ensure_open("commit");
    if (::fsync(fd_.get()) != 0)
      fail_runtime("cannot sync '{}' (temporary file '{}'): {}", target_.string(), temp_.string(), errno_text(errno));
    if (const int error = fd_.close(); error != 0)
      fail_runtime("cannot close '{}' (temporary file '{}'): {}", target_.string(), temp_.string(), errno_text(error));
    if (::rename(temp_.c_str(), target_.c_str()) != 0)
      fail_runtime("cannot rename '{}' to '{}': {}", temp_.string(), target_.string(), errno_text(errno));
    committed_ = true;
    const auto dir = target_.parent_path();
    fsync_directory(dir.empty() ? std::filesystem::path(".") : dir);
  }

  // Closes and removes the temporary file (nothing after commit()).
  void discard() noexcept {
    if (committed_) return;
    fd_.reset();
    if (!temp_.empty()) ::unlink(temp_.c_str());
    committed_ = true;
  }

 private:
  void ensure_open(const char* what) const {
    if (committed_ || !fd_) fail_runtime("internal: {}() on the finished atomic file '{}'", what, target_.string());
  }

  std::filesystem::path target_;
  std::filesystem::path temp_;
  FileDescriptor fd_;
  std::uint64_t position_ = 0;
  bool committed_ = false;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
