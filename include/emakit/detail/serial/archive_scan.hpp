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
// | data.pkl's value  | a module object (OutputArchive files); with Root::dict a dict or          |
// |                   | OrderedDict (Python's torch.save of a dict or a state_dict(), whose       |
// |                   | records may add .format_version and .storage_alignment, byteorder         |
// |                   | 'little'): interop's imports. Its values: None, bool, int, float, str,    |
// |                   | tuple, list, dict, tensors; no cycle, at most 1000 containers deep        |
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

// What data.pkl holds: a module (torch::serialize::OutputArchive) or a dict (Python's torch.save of
// a dict or an OrderedDict, which also writes the records .format_version and .storage_alignment).
enum class Root : std::uint8_t { module, dict };

// A value of a pickle as the scan's checker runs it (PickleChecker, archive_scan-inl.hpp), without
// LibTorch: ids index the arena the values live in. What read_pickle_dict builds a dict root's
// values from (detail/serial/archive_file.hpp).
struct Value {
  enum class Kind : std::uint8_t {
    none,
    boolean,
    integer,
    real,
    string,
    tuple,
    list,
    dict,
    global,
    object,
    storage,
    tensor
  };
  Kind kind = Kind::none;
  Kind element = Kind::none;         // list: the element kind of a typed list (build_intlist ...), none if any
  bool requires_grad = false;        // tensor
  std::int64_t integer = 0;          // integer, boolean; storage: numel; tensor: storage offset;
                                     // global: a storage class's itemsize
  double real = 0;                   // real
  std::string text{};                // string; global: "module.name"; storage: its record's key
  std::string storage_class{};       // storage, tensor: "FloatStorage" ...
  std::vector<std::size_t> items{};  // tuple, list: elements; dict: key, value, key, value ... as set (a
                                     // key set twice is there twice: Python keeps its first place
                                     // and its last value); tensor: its storage
  std::vector<std::int64_t> dims{};  // tensor: sizes, then strides
};

inline std::string_view kind_name(Value::Kind k) {
  static constexpr std::string_view names[] = {"None", "bool", "int",    "float",  "str",     "tuple",
                                               "list", "dict", "global", "object", "storage", "tensor"};
  return names[static_cast<std::size_t>(k)];
}

// The values of a dict root (Root::dict) as the checker ran them: `root` is the dict, and every
// value it reaches is None, a bool, int, float, str, tuple, list (a typed one holding only its
// kind), dict or tensor (its storage's record checked to hold it), at most max_depth containers
// deep and in no cycle.
struct PickleValues {
  static constexpr std::size_t max_depth = 1000;
  std::vector<Value> values;
  std::size_t root = 0;
};

}  // namespace archive_scan

// Reads the file at `path` into memory in one open, scans those bytes and returns them: a caller
// loads the bytes that were checked, never the path again (a file replaced meanwhile, a symlink
// swapped, is not read). Throws std::invalid_argument "emakit: <what>: refusing '<path>': <reason>"
// unless the archive holds only what an emakit checkpoint may hold (see the table above); with
// Root::dict, a torch.save file of a plain dict of tensors and plain values, whose values the
// checker then gives in `values` when asked (read_pickle_dict builds the dict from them).
EMAKIT_FUNC std::vector<char> read_scanned_file(const std::filesystem::path& path, std::string_view what,
                                                archive_scan::Root root = archive_scan::Root::module,
                                                archive_scan::PickleValues* values = nullptr);

// The same scan for bytes in memory (`where` names them in errors).
EMAKIT_FUNC void scan_archive_bytes(std::span<const char> bytes, std::string_view where,
                                    archive_scan::Root root = archive_scan::Root::module,
                                    archive_scan::PickleValues* values = nullptr);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

// The check itself: compiled once per program, in the implementation file, or in every translation
// unit in the all-inline mode, EMAKIT_HEADER_ONLY (detail/config.hpp).

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/archive_scan-inl.hpp>
#endif
