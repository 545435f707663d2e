// Refuses an untrusted checkpoint archive before LibTorch runs anything in it.
//
// LibTorch reads the archives of torch::save / OutputArchive with torch::jit::load: the zip holds
// TorchScript source (code/*.py) that is compiled while loading, pickles (data.pkl,
// constants.pkl, *.debug_pkl) whose globals name classes and functions, and tensor records
// (data/<n>) whose element count the pickle states. A crafted file can make the loader compile
// and run its own methods (a class's __setstate__ runs during the load), or claim a tensor
// larger than its record so that reading the tensor reads past the allocation. The scan below
// reads the archive with LibTorch's zip reader (no code runs) and accepts only what
// torch::serialize::OutputArchive writes for tensors, modules (Module::save), torch::optim
// optimizers (Optimizer::save) and archives nested in archives (LibTorch 1.13 and 2.x): emakit's
// own files, and a hook checkpoint with the optimizer beside it.
//
// | part              | accepted                                                                  |
// |-------------------|---------------------------------------------------------------------------|
// | records           | data.pkl, constants.pkl, version, byteorder, .data/version,               |
// |                   | .data/serialization_id, data/<n>, code/__torch__[/<id>...].py[.debug_pkl] |
// |                   | (not under code/__torch__/torch/: LibTorch's custom C++ classes)          |
// | code/*.py         | class declarations with attribute types only, line by line, printable     |
// |                   | ASCII; in a 'class <Name>(Module):' body, indented two spaces, only:      |
// |                   |   <identifier> : <type>                                                   |
// |                   |   __parameters__ = ["<name>", ...]     (and __buffers__, the same)        |
// |                   |   __annotations__ = []                                                    |
// |                   |   __annotations__["<name>"] = <type>   (a name that is no identifier)     |
// |                   | <type>: names, '.', '[', ']', ',' and spaces; <name>: printable, no '"'   |
// |                   | or '\' (optimizers name state "0x55d0c8a3e2c0" in 1.13, "94222..." in     |
// |                   | 2.x; groups "param_groups/0", "params/size"). No def, decorator, import,  |
// |                   | call or other expression.                                                 |
// | pickles           | protocol 2 opcodes for None, bool, int, float, str, tuple, list, dict;    |
// |                   | globals: torch._utils._rebuild_tensor_v2, torch.<T>Storage,               |
// |                   | collections.OrderedDict, torch.jit._pickle.build_{int,double,bool,        |
// |                   | tensor}list and restore_type_tag (type names only), and __torch__ classes |
// |                   | whose code file is declared as above                                      |
// | tensors           | storage ('storage', torch.<T>Storage, '<n>', 'cpu' or 'cuda[:i]', numel)  |
// |                   | with numel * itemsize <= the size of record data/<n>; sizes and strides   |
// |                   | non-negative and the view inside the storage                              |
// | constants.pkl     | an empty tuple (attribute-only code has no constants)                     |
// | data.pkl's value  | a module object (OutputArchive files); with Root::dict a dict (Python's    |
// |                   | torch.save of a plain dict, whose records may add .format_version and     |
// |                   | .storage_alignment): interop's imports                                    |
//
// Anything else is refused with an error naming the file, the record and what was found. The
// pickles are checked by running them on an abstract stack (values, marks and memo kept as in a
// real unpickler), so every opcode's operands are known when it is checked: one handler per
// accepted opcode (PickleChecker's opcode table), every other opcode refused.
#pragma once

#include <emakit/detail/config.hpp>

#include <caffe2/serialize/read_adapter_interface.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

namespace archive_scan {

// Bytes given by the caller, as LibTorch's zip reader wants them.
class SpanReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit SpanReader(std::span<const char> bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<uint64_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  std::span<const char> bytes_;
};

// What data.pkl holds: a module (torch::serialize::OutputArchive) or a dict (Python's torch.save
// of a plain dict, which also writes the records .format_version and .storage_alignment).
enum class Root : std::uint8_t { module, dict };

// plain_root's signature of an OrderedDict root, and its placeholder keys (see plain_root).
constexpr std::string_view ordered_dict_root{"\x80\x02"
                                             "ccollections\nOrderedDict\nq\x00)Rq\x01",
                                             33};
constexpr std::string_view placeholder{"\0emakit:OrderedDict\0", 20};
constexpr std::string_view nested_placeholder{"\0emakit:NestedOrderedDict\0", 26};

}  // namespace archive_scan

// Reads the file at `path` into memory in one open, scans those bytes and returns them: a caller
// loads the bytes that were checked, never the path again (a file replaced meanwhile, a symlink
// swapped, is not read). Throws std::invalid_argument "emakit: <what>: refusing '<path>': <reason>"
// unless the archive holds only what an emakit checkpoint may hold (see the table above); with
// Root::dict, a torch.save file of a plain dict of tensors and plain values.
EMAKIT_FUNC std::vector<char> read_scanned_file(const std::filesystem::path& path, std::string_view what,
                                                archive_scan::Root root = archive_scan::Root::module);

// The same scan for bytes in memory (`where` names them in errors).
EMAKIT_FUNC void scan_archive_bytes(std::span<const char> bytes, std::string_view where,
                                    archive_scan::Root root = archive_scan::Root::module);

// Python's torch.save(model.state_dict()) pickles (protocol 2, torch.save's) an OrderedDict:
//   PROTO 2, GLOBAL 'collections OrderedDict', BINPUT 0, EMPTY_TUPLE, REDUCE, BINPUT 1,
//   the items (MARK key value ... SETITEMS, in batches of 1000; a batch of one is key value
//   SETITEM), then its _metadata: a dict, BUILD, STOP.
// LibTorch's unpickler (1.13 and 2.x alike) makes OrderedDict() None (it knows that global only
// as a tensor's empty backward hooks) and then fails on the items with an internal assert; it
// reads neither SETITEM nor BUILD on a dict. plain_root rewrites such a pickle into the plain
// dict it holds, with opcodes that unpickler reads:
//   PROTO 2, EMPTY_DICT, MARK, BINUNICODE placeholder, GLOBAL 'collections OrderedDict',
//   BINPUT 0, EMPTY_TUPLE, REDUCE, SETITEMS, BINPUT 1 (the global stays memoized at 0 for the
//   tensors that name it; the placeholder key holds the None it makes and is removed after
//   unpickling), the items with each root-level SETITEM made MARK key value SETITEMS, and no
//   _metadata (its BUILD and the dict before it are dropped). A plain dict's root-level SETITEM
//   (a dict of one entry, or 1000k + 1) is made MARK key value SETITEMS too.
// An OrderedDict inside the dict (a Lightning checkpoint's current_model_state: a model's
// state_dict()) is made a plain dict too, with opcodes LibTorch reads (it has no POP): the
// OrderedDict() that receives items (SETITEM(S)) or its _metadata (BUILD) becomes EMPTY_DICT,
// MARK, BINUNICODE nested_placeholder, <the global> EMPTY_TUPLE REDUCE (None), SETITEMS (the global
// stays memoized), and its BUILD becomes MARK nested_placeholder <the _metadata> SETITEMS; the
// placeholder key is removed from every dict after unpickling. OrderedDict() with neither, a
// tensor's empty backward hooks, stays as it is. Every SETITEM, at any depth, becomes MARK key
// value SETITEMS, and every APPEND MARK value APPENDS.
// The edits come from one walk of the pickle by the scan's checker, which records where each
// container is filled and each OrderedDict made (PickleLayout); a pickle it refuses, or one that
// needs no edit, gives nullopt (LibTorch then reads it or fails, and read_pickle_dict says so).
EMAKIT_FUNC std::optional<std::string> plain_root(std::string_view pickle);

namespace testing {
// A test's seam: when set, read_scanned_file calls it with the path after the scan, before it
// returns (a test replaces the file there and checks that what loads is what was scanned).
using AfterScan = void (*)(const std::filesystem::path&);
EMAKIT_FUNC AfterScan& after_scan() noexcept;
}  // namespace testing

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

// The check itself: compiled once per program, in the implementation file, or in every translation
// unit in the all-inline mode, EMAKIT_HEADER_ONLY (detail/config.hpp).

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/archive_scan-inl.hpp>
#endif
