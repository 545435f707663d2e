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
//
// Anything else is refused with an error naming the file, the record and what was found. The
// pickles are checked by running them on an abstract stack (values, marks and memo kept as in a
// real unpickler), so every opcode's operands are known when it is checked.
#pragma once

#include <emakit/detail/serial/atomic_file.hpp>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/version.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace emakit::detail {

namespace archive_scan {

// Throws std::invalid_argument "emakit: <prefix><message>" (bad input, as every loader's error).
struct Refuse {
  std::string prefix;
  template <class... A>
  [[noreturn]] void operator()(fmt::format_string<A...> format, A&&... args) const {
    throw std::invalid_argument("emakit: " + prefix + fmt::format(format, std::forward<A>(args)...));
  }
};

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

inline bool is_digits(std::string_view s) {
  return !s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
inline bool is_identifier(std::string_view s) {
  if (s.empty() || s.size() > 256 || (s.front() >= '0' && s.front() <= '9')) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}
// An attribute name as LibTorch's code printer quotes it ("param_groups/size", "params/0", an
// optimizer state key "0x55d0c8a3e2c0", a Sequential's child "0"): it writes the name between
// double quotes without escaping it, so a name it can read back has no '"' and no backslash. Such
// a literal is a plain string to TorchScript's lexer, whatever else it holds: it ends at the next
// '"'.
inline bool is_quoted_name_text(std::string_view s) {
  return !s.empty() && s.size() <= 256 &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f && c != '"' && c != '\\'; });
}
// Takes "<name>" off the front of `s`; false (and `s` as it was) when `s` does not start with one.
inline bool take_quoted_name(std::string_view& s) {
  if (!s.starts_with('"')) return false;
  const auto close = s.find('"', 1);
  if (close == std::string_view::npos || !is_quoted_name_text(s.substr(1, close - 1))) return false;
  s.remove_prefix(close + 1);
  return true;
}
// Text a TorchScript type may be written with here: names, '.', '[', ']', ',' and spaces (no
// parentheses, quotes or operators: nothing that could be an expression).
inline bool is_type_text(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
           c == '[' || c == ']' || c == ',' || c == ' ';
  });
}
// Printable text for an error message: at most 60 characters, the rest escaped.
inline std::string shown(std::string_view s) {
  std::string out;
  for (const char c : s.substr(0, 60)) {
    if (c >= 0x20 && c < 0x7f && c != '\'')
      out += c;
    else
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
  }
  if (s.size() > 60) out += "...";
  return out;
}

// The element size of a storage class torch.<name>, or 0 when it is not one.
inline std::int64_t storage_itemsize(std::string_view name) {
  static const std::pair<std::string_view, std::int64_t> known[] = {
      {"FloatStorage", 4},  {"DoubleStorage", 8},      {"HalfStorage", 2},         {"BFloat16Storage", 2},
      {"LongStorage", 8},   {"IntStorage", 4},         {"ShortStorage", 2},        {"CharStorage", 1},
      {"ByteStorage", 1},   {"BoolStorage", 1},        {"ComplexFloatStorage", 8}, {"ComplexDoubleStorage", 16}};
  for (const auto& [n, size] : known)
    if (n == name) return size;
  return 0;
}

// Where the code of class `module`.`name` lives: "__torch__.___torch_mangle_2" -> code/__torch__/___torch_mangle_2.py.
inline std::string code_record(std::string_view module) {
  std::string path = "code/";
  for (const char c : module) path += c == '.' ? '/' : c;
  return path + ".py";
}

// ---- code files ------------------------------------------------------------------------

// Checks one code/*.py record: class declarations with attribute types only. Returns the
// classes it declares.
inline std::set<std::string> check_code(std::string_view text, const std::string& record, const Refuse& refuse) {
  std::set<std::string> classes;
  for (const char c : text)
    if ((c < 0x20 || c >= 0x7f) && c != '\n')
      refuse("{} holds the byte 0x{:02x}; only printable ASCII declarations are accepted", record,
             static_cast<unsigned char>(c));
  bool in_class = false;
  std::size_t line_no = 0;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t end = std::min(text.find('\n', pos), text.size());
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(' ') == std::string_view::npos) continue;
    auto bad = [&](std::string_view why) {
      refuse("{} line {} is '{}': {}; only class declarations with attribute types are accepted, no code", record,
             line_no, shown(line), why);
    };
    if (line.starts_with("class ")) {
      // class <Name>(Module):
      const std::string_view rest = line.substr(6);
      const auto open = rest.find('(');
      if (open == std::string_view::npos || rest.substr(open) != "(Module):" || !is_identifier(rest.substr(0, open)))
        bad("a class must read 'class <Name>(Module):'");
      classes.emplace(rest.substr(0, open));
      in_class = true;
      continue;
    }
    if (!in_class || !line.starts_with("  ") || line[2] == ' ') bad("a statement outside a class body");
    const std::string_view body = line.substr(2);
    if (body.starts_with("__parameters__ = [") || body.starts_with("__buffers__ = [")) {
      // __parameters__ = ["weight", "param_groups/size", ]
      std::string_view list = body.substr(body.find('[') + 1);
      if (!list.ends_with("]")) bad("the name list does not end with ']'");
      list.remove_suffix(1);
      while (!list.empty()) {
        if (!take_quoted_name(list) || !list.starts_with(", "))
          bad("the name list holds something other than quoted names");
        list.remove_prefix(2);
      }
      continue;
    }
    // An attribute whose name is not an identifier (an optimizer's "0x55d0c8a3e2c0", "params/0"):
    //   __annotations__ = []
    //   __annotations__["params/0"] = str
    if (body == "__annotations__ = []") continue;
    if (body.starts_with("__annotations__[")) {
      std::string_view rest = body.substr(std::string_view("__annotations__[").size());
      if (!take_quoted_name(rest) || !rest.starts_with("] = "))
        bad("an __annotations__ entry must read '__annotations__[\"<name>\"] = <type>'");
      const std::string_view type = rest.substr(4);
      if (type.empty() || !is_type_text(type)) bad("an attribute type may hold names, '.', '[', ']' and ',' only");
      continue;
    }
    // <name> : <type>, the type made of identifiers, dots, brackets, commas and spaces only
    const auto colon = body.find(" : ");
    if (colon == std::string_view::npos || !is_identifier(body.substr(0, colon)))
      bad("neither an attribute type nor a parameter or buffer list");
    const std::string_view type = body.substr(colon + 3);
    if (type.empty() || !is_type_text(type)) bad("an attribute type may hold names, '.', '[', ']' and ',' only");
  }
  return classes;
}

// ---- pickles ---------------------------------------------------------------------------

// What the abstract unpickler knows of a value.
struct Value {
  enum class Kind : std::uint8_t { none, boolean, integer, real, string, tuple, list, dict, global, object, storage, tensor };
  Kind kind = Kind::none;
  std::int64_t integer = 0;          // integer; storage: numel; global storage class: itemsize
  std::string text{};                // string; global: "module.name"
  std::vector<std::size_t> items{};  // tuple: element ids (lists and dicts keep none: nothing reads them)
  std::int64_t itemsize = 0;         // storage
};

inline std::string_view kind_name(Value::Kind k) {
  static constexpr std::string_view names[] = {"None", "bool",   "int",    "float",   "str",    "tuple",
                                               "list", "dict",   "global", "object",  "storage", "tensor"};
  return names[static_cast<std::size_t>(k)];
}

struct PickleRules {
  std::string record;                                    // for messages
  const std::set<std::string>* classes = nullptr;        // declared __torch__ classes ("mod.Name")
  std::function<std::int64_t(const std::string&)> data_record_size;  // size of data/<key>, -1 if missing
};

// Runs `bytes` on an abstract stack; refuses anything outside the accepted subset. Returns the
// root value's kind and, for a tuple, its length.
inline std::pair<Value::Kind, std::size_t> check_pickle(std::span<const char> bytes, const PickleRules& rules,
                                                        const Refuse& refuse) {
  const std::string& record = rules.record;
  std::vector<Value> values;             // arena: ids index it; no ownership cycles
  std::vector<std::size_t> stack;        // value ids
  std::vector<std::size_t> marks;        // stack sizes at MARK
  std::map<std::uint32_t, std::size_t> memo;
  std::size_t pos = 0;
  std::size_t op_at = 0;
  unsigned char op = 0;

  auto bad = [&](std::string_view why) {
    refuse("{} at byte {} (opcode 0x{:02x}): {}; only tensors and plain values are accepted", record, op_at, op, why);
  };
  auto need = [&](std::size_t n) -> const char* {
    if (bytes.size() - pos < n) bad("the pickle ends inside an operand");
    const char* p = bytes.data() + pos;
    pos += n;
    return p;
  };
  auto le = [&](std::size_t n) {
    const auto* p = reinterpret_cast<const unsigned char*>(need(n));
    std::uint64_t v = 0;
    for (std::size_t i = n; i-- > 0;) v = (v << 8) | p[i];
    return v;
  };
  auto make = [&](Value v) {
    if (values.size() >= (std::size_t{1} << 24)) bad("more than 16M values");
    values.push_back(std::move(v));
    return values.size() - 1;
  };
  auto push = [&](Value v) { stack.push_back(make(std::move(v))); };
  auto floor_ = [&]() { return marks.empty() ? std::size_t{0} : marks.back(); };
  auto pop = [&]() {
    if (stack.size() <= floor_()) bad("the stack is empty");
    const std::size_t id = stack.back();
    stack.pop_back();
    return id;
  };
  auto pop_mark = [&]() {
    if (marks.empty()) bad("no MARK to pop to");
    const std::size_t at = marks.back();
    marks.pop_back();
    std::vector<std::size_t> items(stack.begin() + static_cast<std::ptrdiff_t>(at), stack.end());
    stack.resize(at);
    return items;
  };
  auto top = [&]() -> std::size_t {
    if (stack.size() <= floor_()) bad("the stack is empty");
    return stack.back();
  };
  auto as_int = [&](std::size_t id, std::string_view what) {
    if (values[id].kind != Value::Kind::integer)
      bad(fmt::format("{} is a {}, not an int", what, kind_name(values[id].kind)));
    return values[id].integer;
  };
  auto ints = [&](std::size_t id, std::string_view what) {
    if (values[id].kind != Value::Kind::tuple)
      bad(fmt::format("{} is a {}, not a tuple of ints", what, kind_name(values[id].kind)));
    if (values[id].items.size() > 64) bad(fmt::format("{} has {} entries (at most 64)", what, values[id].items.size()));
    std::vector<std::int64_t> out;
    for (const std::size_t item : values[id].items) {
      out.push_back(as_int(item, what));
      if (out.back() < 0) bad(fmt::format("{} holds the negative value {}", what, out.back()));
    }
    return out;
  };

  // A tensor view of `storage`: offset, sizes, strides inside it.
  auto rebuild_tensor = [&](const std::vector<std::size_t>& args) {
    if (args.size() != 6 && args.size() != 7)
      bad(fmt::format("_rebuild_tensor_v2 takes 6 or 7 arguments, not {}", args.size()));
    const Value& storage = values[args[0]];
    if (storage.kind != Value::Kind::storage)
      bad(fmt::format("_rebuild_tensor_v2's first argument is a {}, not a storage", kind_name(storage.kind)));
    const std::int64_t offset = as_int(args[1], "the storage offset");
    const auto sizes = ints(args[2], "the tensor's sizes");
    const auto strides = ints(args[3], "the tensor's strides");
    if (values[args[4]].kind != Value::Kind::boolean) bad("requires_grad is not a bool");
    if (values[args[5]].kind != Value::Kind::dict) bad("the backward hooks are not a dict");
    if (sizes.size() != strides.size())
      bad(fmt::format("the tensor has {} sizes and {} strides", sizes.size(), strides.size()));
    if (sizes.size() > 64) bad(fmt::format("the tensor has {} dimensions (at most 64)", sizes.size()));
    if (offset < 0) bad(fmt::format("the storage offset {} is negative", offset));
    // The last element's index (overflow counts as past the end); a zero size makes it empty.
    bool empty = false, overflow = false;
    std::uint64_t last = static_cast<std::uint64_t>(offset);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] == 0) empty = true;
      std::uint64_t reach = 0;
      overflow |= __builtin_mul_overflow(static_cast<std::uint64_t>(sizes[i] > 0 ? sizes[i] - 1 : 0),
                                         static_cast<std::uint64_t>(strides[i]), &reach);
      overflow |= __builtin_add_overflow(last, reach, &last);
    }
    if (!empty && (overflow || last >= static_cast<std::uint64_t>(storage.integer)))
      bad(fmt::format("the tensor (offset {}, sizes [{}], strides [{}]) reaches past its storage of {} elements", offset,
                      fmt::join(sizes, ", "), fmt::join(strides, ", "), storage.integer));
    return Value{.kind = Value::Kind::tensor};
  };

  auto persistent = [&](std::size_t id) {
    const Value& pid = values[id];
    if (pid.kind != Value::Kind::tuple || pid.items.size() != 5)
      bad("a persistent id must be ('storage', torch.<T>Storage, key, location, numel)");
    const Value& tag = values[pid.items[0]];
    const Value& cls = values[pid.items[1]];
    const Value& key = values[pid.items[2]];
    const Value& location = values[pid.items[3]];
    if (tag.kind != Value::Kind::string || tag.text != "storage") bad("a persistent id that is not a 'storage'");
    if (cls.kind != Value::Kind::global || cls.integer <= 0) bad("a storage whose type is not torch.<T>Storage");
    if (key.kind != Value::Kind::string || !is_digits(key.text)) bad("a storage key that is not a number");
    if (location.kind != Value::Kind::string ||
        !(location.text == "cpu" || location.text == "cuda" ||
          (location.text.starts_with("cuda:") && is_digits(std::string_view(location.text).substr(5)))))
      bad(fmt::format("the storage location '{}' (expected 'cpu' or 'cuda[:i]')",
                      shown(location.kind == Value::Kind::string ? location.text : "?")));
    const std::int64_t numel = as_int(pid.items[4], "the storage's element count");
    if (numel < 0) bad(fmt::format("the storage's element count {} is negative", numel));
    const std::int64_t have = rules.data_record_size(key.text);
    if (have < 0) bad(fmt::format("the storage names the record data/{}, which the archive lacks", key.text));
    std::uint64_t want = 0;
    if (__builtin_mul_overflow(static_cast<std::uint64_t>(numel), static_cast<std::uint64_t>(cls.integer), &want) ||
        want > static_cast<std::uint64_t>(have))
      bad(fmt::format("the storage claims {} elements of {} bytes, but the record data/{} holds {} bytes", numel,
                      cls.integer, key.text, have));
    return Value{.kind = Value::Kind::storage, .integer = numel, .itemsize = cls.integer};
  };

  auto global = [&](std::string module, std::string name) {
    Value v{.kind = Value::Kind::global, .text = module + "." + name};
    if (module == "torch._utils" && name == "_rebuild_tensor_v2") return v;
    if (module == "collections" && name == "OrderedDict") return v;
    if (module == "torch.jit._pickle" &&
        (name == "build_intlist" || name == "build_doublelist" || name == "build_boollist" ||
         name == "build_tensorlist" || name == "restore_type_tag"))
      return v;
    if (module == "torch" && storage_itemsize(name) > 0) {
      v.integer = storage_itemsize(name);
      return v;
    }
    if ((module == "__torch__" || module.starts_with("__torch__.")) && module != "__torch__.torch" &&
        !module.starts_with("__torch__.torch.") && rules.classes != nullptr && rules.classes->count(v.text) != 0)
      return v;
    if (module == "__torch__" || module.starts_with("__torch__."))
      bad(fmt::format("the class '{}' has no declaration-only code file {}", shown(v.text), code_record(module)));
    bad(fmt::format("the global '{}'", shown(v.text)));
    return v;  // not reached: bad() throws
  };

  auto read_line = [&]() {
    const auto* begin = bytes.data() + pos;
    const auto* nl = static_cast<const char*>(std::memchr(begin, '\n', bytes.size() - pos));
    if (nl == nullptr) bad("a GLOBAL name without its newline");
    std::string s(begin, nl);
    pos += s.size() + 1;
    return s;
  };

  if (bytes.size() < 2 || static_cast<unsigned char>(bytes[0]) != 0x80)
    refuse("{} is not a pickle (it does not start with the PROTO opcode)", record);
  while (true) {
    if (pos >= bytes.size()) {
      op_at = pos;
      bad("the pickle ends without STOP");
    }
    op_at = pos;
    op = static_cast<unsigned char>(bytes[pos++]);
    switch (op) {
      case 0x80: {  // PROTO
        const auto v = le(1);
        if (op_at != 0 || v < 2 || v > 5) bad(fmt::format("PROTO {} (expected protocol 2..5, first)", v));
        break;
      }
      case 'c': {  // GLOBAL module\nname\n
        std::string module = read_line();
        std::string name = read_line();
        push(global(std::move(module), std::move(name)));
        break;
      }
      case 'q':    // BINPUT
      case 'r': {  // LONG_BINPUT
        // A pickler numbers its memo entries 0, 1, 2, ...: never more of them than values made.
        // LibTorch's unpickler reserves memory for an index as large as it is told (a flipped
        // byte: gigabytes), so a larger one is refused here.
        const auto key = static_cast<std::uint32_t>(le(op == 'q' ? 1 : 4));
        if (key > values.size())
          bad(fmt::format("a memo index {} past the {} values made so far", key, values.size()));
        memo[key] = top();
        break;
      }
      case 'h':                                                           // BINGET
      case 'j': {                                                         // LONG_BINGET
        const auto key = static_cast<std::uint32_t>(le(op == 'h' ? 1 : 4));
        const auto it = memo.find(key);
        if (it == memo.end()) bad(fmt::format("the memo has no entry {}", key));
        stack.push_back(it->second);
        break;
      }
      case ')': push(Value{.kind = Value::Kind::tuple}); break;
      case '}': push(Value{.kind = Value::Kind::dict}); break;
      case ']': push(Value{.kind = Value::Kind::list}); break;
      case '(':
        if (marks.size() >= 1000) bad("more than 1000 nested MARKs");
        marks.push_back(stack.size());
        break;
      case 't': push(Value{.kind = Value::Kind::tuple, .items = pop_mark()}); break;
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        const std::size_t n = op - 0x84;
        std::vector<std::size_t> items(n);
        for (std::size_t i = n; i-- > 0;) items[i] = pop();
        push(Value{.kind = Value::Kind::tuple, .items = std::move(items)});
        break;
      }
      case 'N': push(Value{}); break;
      case 0x88:
      case 0x89: push(Value{.kind = Value::Kind::boolean, .integer = op == 0x88}); break;
      case 'K': push(Value{.kind = Value::Kind::integer, .integer = static_cast<std::int64_t>(le(1))}); break;
      case 'M': push(Value{.kind = Value::Kind::integer, .integer = static_cast<std::int64_t>(le(2))}); break;
      case 'J':
        push(Value{.kind = Value::Kind::integer,
                   .integer = static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4)))});
        break;
      case 0x8a: {  // LONG1: n little-endian two's complement bytes
        const auto n = static_cast<std::size_t>(le(1));
        if (n > 8) bad(fmt::format("an integer of {} bytes (at most 8)", n));
        std::uint64_t v = n == 0 ? 0 : le(n);
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) != 0) v |= ~std::uint64_t{0} << (8 * n);  // sign-extend
        push(Value{.kind = Value::Kind::integer, .integer = static_cast<std::int64_t>(v)});
        break;
      }
      case 'G': need(8); push(Value{.kind = Value::Kind::real}); break;
      case 'X':
      case 0x8c: {  // BINUNICODE, SHORT_BINUNICODE
        const auto n = le(op == 'X' ? 4 : 1);
        if (n > bytes.size()) bad(fmt::format("a string of {} bytes in a pickle of {}", n, bytes.size()));
        const char* p = need(static_cast<std::size_t>(n));
        push(Value{.kind = Value::Kind::string, .text = std::string(p, static_cast<std::size_t>(n))});
        break;
      }
      case 'a': {  // APPEND
        const std::size_t item = pop();
        const std::size_t list = top();
        if (values[list].kind != Value::Kind::list) bad("APPEND to something other than a list");
        (void)item;
        break;
      }
      case 'e': {  // APPENDS
        (void)pop_mark();
        const std::size_t list = top();
        if (values[list].kind != Value::Kind::list) bad("APPENDS to something other than a list");
        break;
      }
      case 's':
      case 'u': {  // SETITEM, SETITEMS
        std::vector<std::size_t> items;
        if (op == 's') {
          const std::size_t value = pop();
          items = {pop(), value};
        } else {
          items = pop_mark();
        }
        if (items.size() % 2 != 0) bad("SETITEMS with an odd number of keys and values");
        const std::size_t dict = top();
        if (values[dict].kind != Value::Kind::dict) bad("SETITEM on something other than a dict");
        for (std::size_t i = 0; i < items.size(); i += 2) {
          const auto k = values[items[i]].kind;
          if (k != Value::Kind::string && k != Value::Kind::integer && k != Value::Kind::boolean &&
              k != Value::Kind::real && k != Value::Kind::tensor)
            bad(fmt::format("a dict key that is a {}", kind_name(k)));
        }
        break;
      }
      case 'Q': push(persistent(pop())); break;  // BINPERSID
      case 'R': {                                // REDUCE
        const std::size_t args = pop();
        const std::size_t callable = pop();
        if (values[callable].kind != Value::Kind::global) bad("REDUCE of something that is not a global");
        if (values[args].kind != Value::Kind::tuple) bad("REDUCE with arguments that are not a tuple");
        const std::string name = values[callable].text;
        const auto& a = values[args].items;  // read before push() moves the arena
        if (name == "torch._utils._rebuild_tensor_v2") {
          push(rebuild_tensor(a));
        } else if (name == "collections.OrderedDict") {
          if (!a.empty()) bad("OrderedDict called with arguments");
          push(Value{.kind = Value::Kind::dict});
        } else if (name == "torch.jit._pickle.restore_type_tag") {
          // (value, "Dict[str, Tensor]"): the value with its TorchScript type; the type is parsed
          // by LibTorch's type parser, which only names types.
          if (a.size() != 2 || values[a[1]].kind != Value::Kind::string) bad("restore_type_tag without (value, type)");
          const std::string& type = values[a[1]].text;
          if (type.size() > 256 || !is_type_text(type)) bad(fmt::format("the type tag '{}'", shown(type)));
          stack.push_back(a[0]);  // the same value, shared
        } else if (name.starts_with("torch.jit._pickle.build_")) {
          if (a.size() != 1 || values[a[0]].kind != Value::Kind::list) bad(fmt::format("{} without one list", name));
          push(Value{.kind = Value::Kind::list});
        } else {
          bad(fmt::format("the global '{}' called", shown(name)));
        }
        break;
      }
      case 0x81: {  // NEWOBJ
        const std::size_t args = pop();
        const std::size_t cls = pop();
        if (values[cls].kind != Value::Kind::global || !values[cls].text.starts_with("__torch__"))
          bad("NEWOBJ of something other than a declared __torch__ class");
        if (values[args].kind != Value::Kind::tuple || !values[args].items.empty())
          bad("NEWOBJ with constructor arguments");
        push(Value{.kind = Value::Kind::object, .text = values[cls].text});
        break;
      }
      case 'b': {  // BUILD
        const std::size_t state = pop();
        const std::size_t target = top();
        if (values[state].kind != Value::Kind::dict) bad("BUILD with a state that is not a dict");
        if (values[target].kind != Value::Kind::object && values[target].kind != Value::Kind::dict)
          bad(fmt::format("BUILD of a {}", kind_name(values[target].kind)));
        break;
      }
      case '.': {  // STOP
        if (!marks.empty()) bad("STOP inside a MARK");
        if (stack.size() != 1) bad(fmt::format("STOP with {} values on the stack (expected 1)", stack.size()));
        if (pos != bytes.size()) bad(fmt::format("{} bytes after STOP", bytes.size() - pos));
        const Value& root = values[stack.back()];
        return {root.kind, root.items.size()};
      }
      default: bad("an opcode outside the accepted subset");
    }
  }
}

// ---- the archive -----------------------------------------------------------------------

inline std::vector<char> record_bytes(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [data, size] = reader.getRecord(name);
  const auto* p = static_cast<const char*>(data.get());
  return std::vector<char>(p, p + size);
}

inline std::int64_t record_size(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  if (!reader.hasRecord(name)) return -1;
#if TORCH_VERSION_MAJOR >= 2
  return static_cast<std::int64_t>(reader.getRecordSize(name));
#else
  return static_cast<std::int64_t>(std::get<1>(reader.getRecord(name)));  // reads it: 1.13 has no getRecordSize
#endif
}

inline void check_records(caffe2::serialize::PyTorchStreamReader& reader, const Refuse& refuse) {
  const auto names = reader.getAllRecords();
  std::set<std::string> classes;
  std::vector<std::string> code, debug;
  for (const auto& name : names) {
    const std::string_view n = name;
    if (n == "data.pkl" || n == "constants.pkl" || n == "version" || n == ".data/version" || n == "byteorder" ||
        n == ".data/serialization_id")
      continue;
    if (n.starts_with("data/") && is_digits(n.substr(5))) continue;
    if (n.starts_with("code/")) {
      std::string_view path = n.substr(5);
      const bool is_debug = path.ends_with(".py.debug_pkl");
      if (is_debug) path.remove_suffix(std::string_view(".debug_pkl").size());
      if (path.ends_with(".py")) {
        path.remove_suffix(3);
        // __torch__.torch.* is LibTorch's own namespace (custom C++ classes, whose __setstate__ is
        // C++ code of the process): never a class of a saved module or optimizer.
        bool ok = (path == "__torch__" || path.starts_with("__torch__/")) && path != "__torch__/torch" &&
                  !path.starts_with("__torch__/torch/");
        for (std::size_t at = 0; ok && at <= path.size();) {
          const std::size_t slash = std::min(path.find('/', at), path.size());
          ok = is_identifier(path.substr(at, slash - at));
          at = slash + 1;
        }
        if (ok) {
          (is_debug ? debug : code).push_back(name);
          continue;
        }
      }
    }
    refuse("the archive holds the record '{}', which is not part of an emakit checkpoint", shown(name));
  }
  for (const std::string& record : {std::string("data.pkl"), std::string("version")})
    if (!reader.hasRecord(record)) refuse("the archive has no record '{}'", record);

  for (const auto& name : code) {
    const auto text = record_bytes(reader, name);
    std::string module = name.substr(5, name.size() - 5 - 3);
    std::replace(module.begin(), module.end(), '/', '.');
    for (const auto& cls : check_code(std::string_view(text.data(), text.size()), name, refuse))
      classes.insert(module + "." + cls);
  }
  std::map<std::string, std::int64_t> sizes;  // a record named by many storages is measured once
  auto data_size = [&](const std::string& key) {
    const auto [it, added] = sizes.try_emplace(key, 0);
    if (added) it->second = record_size(reader, "data/" + key);
    return it->second;
  };
  for (const auto& name : debug) {
    const auto bytes = record_bytes(reader, name);
    const auto [kind, n] = check_pickle(bytes, PickleRules{name, nullptr, data_size}, refuse);
    if (kind != Value::Kind::tuple) refuse("{} holds a {}, not a tuple", name, kind_name(kind));
  }
  if (reader.hasRecord("constants.pkl")) {
    const auto bytes = record_bytes(reader, "constants.pkl");
    const auto [kind, n] = check_pickle(bytes, PickleRules{"constants.pkl", nullptr, data_size}, refuse);
    if (kind != Value::Kind::tuple || n != 0)
      refuse("constants.pkl holds a {} of {} items; an emakit checkpoint has no constants", kind_name(kind), n);
  }
  const auto bytes = record_bytes(reader, "data.pkl");
  const auto [kind, n] = check_pickle(bytes, PickleRules{"data.pkl", &classes, data_size}, refuse);
  if (kind != Value::Kind::object) refuse("data.pkl holds a {}, not a module", kind_name(kind));
}

// Opens the zip with LibTorch's reader; its errors become refusals.
template <class Open>
void scan(const Open& open, const Refuse& refuse) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = open();
  } catch (const c10::Error& e) {
    std::string reason = e.what_without_backtrace();
    if (const auto nl = reason.find('\n'); nl != std::string::npos) reason.resize(nl);
    refuse("it is not a readable zip archive (truncated or damaged?): {}", reason);
  }
  try {
    check_records(*reader, refuse);
  } catch (const c10::Error& e) {
    std::string reason = e.what_without_backtrace();
    if (const auto nl = reason.find('\n'); nl != std::string::npos) reason.resize(nl);
    refuse("a record cannot be read (truncated or damaged?): {}", reason);
  }
}

}  // namespace archive_scan

// Throws std::invalid_argument "emakit: <what>: refusing '<path>': <reason>" unless the archive at
// `path` holds only what an emakit checkpoint may hold (see the table above).
inline void scan_archive_file(const std::filesystem::path& path, std::string_view what) {
  const archive_scan::Refuse refuse{fmt::format("{}: refusing '{}': ", what, path.string())};
  archive_scan::scan([&] { return std::make_unique<caffe2::serialize::PyTorchStreamReader>(path.string()); }, refuse);
}

// The same for bytes in memory (`where` names them in errors).
inline void scan_archive_bytes(std::span<const char> bytes, std::string_view where) {
  const archive_scan::Refuse refuse{fmt::format("refusing {}: ", where)};
  archive_scan::scan(
      [&] {
        return std::make_unique<caffe2::serialize::PyTorchStreamReader>(
            std::make_shared<archive_scan::SpanReader>(bytes));
      },
      refuse);
}

}  // namespace emakit::detail
