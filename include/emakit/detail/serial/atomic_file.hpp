// Files that appear whole or not at all (POSIX).
//
//   emakit::detail::AtomicFile out("/runs/a/snapshot.emkit");   // creates /runs/a/.snapshot.emkit.tmp-<pid>-<n>
//   out.write(header, size);                                      // or write_at(offset, ...)
//   out.commit();      // fsync the file, rename it over the target, fsync the folder
//   // without commit() (an exception, an early return) the destructor removes the temporary file
//
// The temporary file lives in the target's folder (rename is atomic only within one file
// system) and its name starts with '.' and holds ".tmp-", so a reader that lists a folder can
// tell it from finished files (is_temporary_name). A process killed at any point leaves the
// previous file under the target name intact (or no file, if there was none) plus at most one
// stale temporary file; after commit() returns, the new file survives a power loss.
//
// Failures throw std::runtime_error naming the file and the system's reason.
#pragma once

#include <emakit/detail/config.hpp>

#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// True for the names AtomicFile gives its temporary files.
EMAKIT_FUNC bool is_temporary_name(std::string_view filename);

// Writes `bytes` to `target` atomically.
EMAKIT_FUNC void write_file_atomically(const std::filesystem::path& target, std::span<const char> bytes);

// The whole of `path`, read in one open: a caller that checks these bytes and then uses them uses
// what it checked, whatever replaces the file meanwhile. Throws std::runtime_error naming `what`
// and the file if it cannot be opened or read, or if its size changes while it is read.
EMAKIT_FUNC std::vector<char> read_file_bytes(const std::filesystem::path& path, std::string_view what);

// Throws unless a file can be created in `folder` (creates and removes a temporary file). The
// error names `target` when given (the file about to be written), else the folder.
EMAKIT_FUNC void check_writable_folder(const std::filesystem::path& folder, const std::filesystem::path& target = {});

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

// FileDescriptor and AtomicFile themselves are in posix_file.hpp, which only the definitions of the
// file formats include (the implementation files, or every translation unit in the all-inline
// mode: detail/config.hpp).

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/atomic_file-inl.hpp>
#endif
