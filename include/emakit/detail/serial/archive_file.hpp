// Archive files, the one read path and the one write path of every emakit checkpoint: a file is
// written atomically (atomic_file.hpp) and read into memory once; archive_scan.hpp checks those
// bytes and LibTorch loads the same bytes, so its loader never runs on a file that holds code,
// unknown records or oversized tensors, even one replaced between the check and the load.
//
//   read_archive(archive, path, "emakit::load")      // an OutputArchive file: read, scan, load
//   write_archive(archive, path)                      // atomically
//   read_pickle_dict(path, "import_state")            // a torch.save file of a dict or state_dict(),
//                                                     // read from the values the scan checked
//
// A path that is missing or a directory is refused by name before anything is opened.
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Dict.h>
#include <c10/core/Allocator.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>
#include <tuple>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

namespace archive_scan {
struct PickleValues;  // archive_scan.hpp
}

// Opens an archive file for reading. The file is scanned first: one that holds code, unknown
// records or tensors larger than their data is refused before LibTorch's loader runs anything
// in it; a missing, truncated or damaged file is an error that names it.
EMAKIT_FUNC void read_archive(torch::serialize::InputArchive& archive, const std::filesystem::path& path,
                              const char* what);

// Writes an archive to `path` atomically.
EMAKIT_FUNC void write_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path);

// Reads a file of Python's torch.save(dict), torch.save(model.state_dict()) (an OrderedDict, which
// LibTorch's own unpickler cannot read), or torch_pickle.hpp's write_tensor_dict, after the same
// scan: a dict of tensors and plain values, nothing else. The scan's checker gives the values it
// ran (archive_scan::PickleValues) and build_pickle_dict makes them; LibTorch's unpickler does not
// run. An OrderedDict is read as the dict it holds (its _metadata dropped), at the root or inside.
EMAKIT_FUNC c10::impl::GenericDict read_pickle_dict(const std::filesystem::path& path, const char* what);

// A storage's record data/<key>: its bytes and their size (PyTorchStreamReader::getRecord's).
using ReadRecord = std::function<std::tuple<at::DataPtr, std::size_t>(const std::string& key)>;

// The dict of checked values: None, bool, int, float, str, tuple, list (a typed one as LibTorch
// types it: build_intlist an int list ...), dict (a key set twice: its first place, its last
// value) and tensors on the CPU, whatever device they were saved from (a caller copies them where
// it needs them), with their dtype, view and requires_grad; the tensors of one record share one
// storage. A value reached twice is one value, as in Python.
EMAKIT_FUNC c10::impl::GenericDict build_pickle_dict(const archive_scan::PickleValues& values,
                                                     const ReadRecord& record);

// Refuses a checkpoint path that does not exist or is not a regular file (a directory), by name.
EMAKIT_FUNC void check_checkpoint_path(const std::filesystem::path& path, const char* what);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/archive_file-inl.hpp>
#endif
