// The non-template definitions of archive_scan.hpp: included at the end of
// archive_scan.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/archive_scan-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/archive_scan.hpp> instead"
#endif

#include <emakit/detail/serial/archive_scan.hpp>

#include <emakit/detail/errors.hpp>
#include <emakit/detail/serial/atomic_file.hpp>
#include <emakit/detail/testing.hpp>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/version.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
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
#include <tuple>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

namespace archive_scan {

// Fails with "emakit: <prefix><message>" (detail::fail: bad input, as every loader's error).
struct Refuse {
  std::string prefix;
  template <class... A>
  [[noreturn]] void operator()(fmt::format_string<A...> format, A&&... args) const {
    fail("{}{}", prefix, fmt::format(format, std::forward<A>(args)...));
  }
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
      {"FloatStorage", 4}, {"DoubleStorage", 8}, {"HalfStorage", 2},         {"BFloat16Storage", 2},
      {"LongStorage", 8},  {"IntStorage", 4},    {"ShortStorage", 2},        {"CharStorage", 1},
      {"ByteStorage", 1},  {"BoolStorage", 1},   {"ComplexFloatStorage", 8}, {"ComplexDoubleStorage", 16}};
  for (const auto& [n, size] : known)
    if (n == name) return size;
  return 0;
}

// Where the code of class `module`.`name` lives: "__torch__.___torch_mangle_2" ->
// code/__torch__/___torch_mangle_2.py.
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

struct PickleRules {
  std::string record;                                                // for messages
  const std::set<std::string>* classes = nullptr;                    // declared __torch__ classes ("mod.Name")
  std::function<std::int64_t(const std::string&)> data_record_size;  // size of data/<key>, -1 if missing
};

// The abstract unpickler: the state a real unpickler keeps (values, stack, marks, memo), with one
// handler per accepted opcode in a table (opcode_table below). An opcode without a handler is
// refused. Every handler checks its operands before it changes the state. The values are kept
// whole (a container its items, a tensor its storage and view), so a dict root's values can be
// given to read_pickle_dict, which builds them (dict_values).
class PickleChecker {
 public:
  PickleChecker(std::span<const char> bytes, const PickleRules& rules, const Refuse& refuse)
      : bytes_(bytes), rules_(rules), refuse_(refuse) {}

  // Runs the pickle to STOP; returns the root value's kind and, for a tuple, its length.
  std::pair<Value::Kind, std::size_t> run();

  // After run() of a dict root: its values, checked as PickleValues says (plain values only, no
  // cycle, at most max_depth containers deep); the checker's arena moves into them.
  PickleValues dict_values() &&;

 private:
  using Handler = void (PickleChecker::*)();
  struct OpcodeTable;

  [[noreturn]] void bad(std::string_view why) const {
    refuse_("{} at byte {} (opcode 0x{:02x}): {}; only tensors and plain values are accepted", rules_.record, op_at_,
            op_, why);
  }
  const char* need(std::size_t n) {
    if (bytes_.size() - pos_ < n) bad("the pickle ends inside an operand");
    const char* p = bytes_.data() + pos_;
    pos_ += n;
    return p;
  }
  std::uint64_t le(std::size_t n) {
    const auto* p = reinterpret_cast<const unsigned char*>(need(n));
    std::uint64_t v = 0;
    for (std::size_t i = n; i-- > 0;) v = (v << 8) | p[i];
    return v;
  }
  std::size_t make(Value v) {
    if (values_.size() >= (std::size_t{1} << 24)) bad("more than 16M values");
    values_.push_back(std::move(v));
    return values_.size() - 1;
  }
  void push(Value v) { push_id(make(std::move(v))); }
  void push_id(std::size_t id) { stack_.push_back(id); }
  std::size_t floor() const { return marks_.empty() ? std::size_t{0} : marks_.back(); }
  std::size_t pop() {
    if (stack_.size() <= floor()) bad("the stack is empty");
    const std::size_t id = stack_.back();
    stack_.pop_back();
    return id;
  }
  std::vector<std::size_t> pop_mark() {
    if (marks_.empty()) bad("no MARK to pop to");
    const std::size_t at = marks_.back();
    marks_.pop_back();
    std::vector<std::size_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(at), stack_.end());
    stack_.resize(at);
    return items;
  }
  std::size_t top() const {
    if (stack_.size() <= floor()) bad("the stack is empty");
    return stack_.back();
  }
  std::int64_t as_int(std::size_t id, std::string_view what) const {
    if (values_[id].kind != Value::Kind::integer)
      bad(fmt::format("{} is a {}, not an int", what, kind_name(values_[id].kind)));
    return values_[id].integer;
  }
  std::vector<std::int64_t> ints(std::size_t id, std::string_view what) const {
    if (values_[id].kind != Value::Kind::tuple)
      bad(fmt::format("{} is a {}, not a tuple of ints", what, kind_name(values_[id].kind)));
    if (values_[id].items.size() > 64)
      bad(fmt::format("{} has {} entries (at most 64)", what, values_[id].items.size()));
    std::vector<std::int64_t> out;
    for (const std::size_t item : values_[id].items) {
      out.push_back(as_int(item, what));
      if (out.back() < 0) bad(fmt::format("{} holds the negative value {}", what, out.back()));
    }
    return out;
  }
  std::string read_line() {
    const auto* begin = bytes_.data() + pos_;
    const auto* nl = static_cast<const char*>(std::memchr(begin, '\n', bytes_.size() - pos_));
    if (nl == nullptr) bad("a GLOBAL name without its newline");
    std::string s(begin, nl);
    pos_ += s.size() + 1;
    return s;
  }

  // A tensor view of `storage`: offset, sizes, strides inside it.
  Value rebuild_tensor(const std::vector<std::size_t>& args) const {
    if (args.size() != 6 && args.size() != 7)
      bad(fmt::format("_rebuild_tensor_v2 takes 6 or 7 arguments, not {}", args.size()));
    const Value& storage = values_[args[0]];
    if (storage.kind != Value::Kind::storage)
      bad(fmt::format("_rebuild_tensor_v2's first argument is a {}, not a storage", kind_name(storage.kind)));
    const std::int64_t offset = as_int(args[1], "the storage offset");
    const auto sizes = ints(args[2], "the tensor's sizes");
    const auto strides = ints(args[3], "the tensor's strides");
    if (values_[args[4]].kind != Value::Kind::boolean) bad("requires_grad is not a bool");
    if (values_[args[5]].kind != Value::Kind::dict) bad("the backward hooks are not a dict");
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
      bad(fmt::format("the tensor (offset {}, sizes [{}], strides [{}]) reaches past its storage of {} elements",
                      offset, fmt::join(sizes, ", "), fmt::join(strides, ", "), storage.integer));
    Value tensor{.kind = Value::Kind::tensor,
                 .requires_grad = values_[args[4]].integer != 0,
                 .integer = offset,
                 .storage_class = storage.storage_class,
                 .items = {args[0]},
                 .dims = sizes};
    tensor.dims.insert(tensor.dims.end(), strides.begin(), strides.end());
    return tensor;
  }

  // ('storage', torch.<T>Storage, key, location, numel), its record large enough.
  Value persistent(std::size_t id) const {
    const Value& pid = values_[id];
    if (pid.kind != Value::Kind::tuple || pid.items.size() != 5)
      bad("a persistent id must be ('storage', torch.<T>Storage, key, location, numel)");
    const Value& tag = values_[pid.items[0]];
    const Value& cls = values_[pid.items[1]];
    const Value& key = values_[pid.items[2]];
    const Value& location = values_[pid.items[3]];
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
    const std::int64_t have = rules_.data_record_size(key.text);
    if (have < 0) bad(fmt::format("the storage names the record data/{}, which the archive lacks", key.text));
    std::uint64_t want = 0;
    if (__builtin_mul_overflow(static_cast<std::uint64_t>(numel), static_cast<std::uint64_t>(cls.integer), &want) ||
        want > static_cast<std::uint64_t>(have))
      bad(fmt::format("the storage claims {} elements of {} bytes, but the record data/{} holds {} bytes", numel,
                      cls.integer, key.text, have));
    return Value{.kind = Value::Kind::storage,
                 .integer = numel,
                 .text = key.text,
                 .storage_class = cls.text.substr(std::string_view("torch.").size())};
  }

  // A global the accepted subset names (see the table at the top of this file).
  Value global(const std::string& module, const std::string& name) const {
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
        !module.starts_with("__torch__.torch.") && rules_.classes != nullptr && rules_.classes->count(v.text) != 0)
      return v;
    if (module == "__torch__" || module.starts_with("__torch__."))
      bad(fmt::format("the class '{}' has no declaration-only code file {}", shown(v.text), code_record(module)));
    bad(fmt::format("the global '{}'", shown(v.text)));
  }

  // ---- one handler per opcode ----

  void proto() {  // PROTO
    const auto v = le(1);
    if (op_at_ != 0 || v < 2 || v > 5) bad(fmt::format("PROTO {} (expected protocol 2..5, first)", v));
  }
  void global_op() {  // GLOBAL module\nname\n
    std::string module = read_line();
    std::string name = read_line();
    push(global(module, name));
  }
  void binput() {  // BINPUT, LONG_BINPUT
    // A pickler numbers its memo entries 0, 1, 2, ...: never more of them than values made.
    // LibTorch's unpickler reserves memory for an index as large as it is told (a flipped
    // byte: gigabytes), so a larger one is refused here.
    const auto key = static_cast<std::uint32_t>(le(op_ == 'q' ? 1 : 4));
    if (key > values_.size()) bad(fmt::format("a memo index {} past the {} values made so far", key, values_.size()));
    memo_[key] = top();
  }
  void binget() {  // BINGET, LONG_BINGET
    const auto key = static_cast<std::uint32_t>(le(op_ == 'h' ? 1 : 4));
    const auto it = memo_.find(key);
    if (it == memo_.end()) bad(fmt::format("the memo has no entry {}", key));
    push_id(it->second);
  }
  void empty_tuple() { push(Value{.kind = Value::Kind::tuple}); }
  void empty_dict() { push(Value{.kind = Value::Kind::dict}); }
  void empty_list() { push(Value{.kind = Value::Kind::list}); }
  void mark() {
    if (marks_.size() >= 1000) bad("more than 1000 nested MARKs");
    marks_.push_back(stack_.size());
  }
  void tuple() { push(Value{.kind = Value::Kind::tuple, .items = pop_mark()}); }
  void small_tuple() {  // TUPLE1..3
    const std::size_t n = op_ - 0x84;
    std::vector<std::size_t> items(n);
    for (std::size_t i = n; i-- > 0;) items[i] = pop();
    push(Value{.kind = Value::Kind::tuple, .items = std::move(items)});
  }
  void none() { push(Value{}); }
  void boolean() { push(Value{.kind = Value::Kind::boolean, .integer = op_ == 0x88}); }
  void binint1() { push(Value{.kind = Value::Kind::integer, .integer = static_cast<std::int64_t>(le(1))}); }
  void binint2() { push(Value{.kind = Value::Kind::integer, .integer = static_cast<std::int64_t>(le(2))}); }
  void binint() {
    push(Value{.kind = Value::Kind::integer, .integer = static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4)))});
  }
  void long1() {  // n little-endian two's complement bytes
    const auto n = static_cast<std::size_t>(le(1));
    if (n > 8) bad(fmt::format("an integer of {} bytes (at most 8)", n));
    std::uint64_t v = n == 0 ? 0 : le(n);
    if (n > 0 && n < 8 && (v >> (8 * n - 1)) != 0) v |= ~std::uint64_t{0} << (8 * n);  // sign-extend
    push(Value{.kind = Value::Kind::integer, .integer = static_cast<std::int64_t>(v)});
  }
  void binfloat() {  // big-endian IEEE 754 double
    const auto* p = reinterpret_cast<const unsigned char*>(need(8));
    std::uint64_t bits = 0;
    for (std::size_t i = 0; i < 8; ++i) bits = (bits << 8) | p[i];
    double v = 0;
    std::memcpy(&v, &bits, sizeof v);
    push(Value{.kind = Value::Kind::real, .real = v});
  }
  void unicode() {  // BINUNICODE, SHORT_BINUNICODE
    const auto n = le(op_ == 'X' ? 4 : 1);
    if (n > bytes_.size()) bad(fmt::format("a string of {} bytes in a pickle of {}", n, bytes_.size()));
    const char* p = need(static_cast<std::size_t>(n));
    push(Value{.kind = Value::Kind::string, .text = std::string(p, static_cast<std::size_t>(n))});
  }
  void append() {  // APPEND, APPENDS
    const std::vector<std::size_t> items = op_ == 'a' ? std::vector<std::size_t>{pop()} : pop_mark();
    Value& list = values_[top()];
    if (list.kind != Value::Kind::list) bad("APPEND to something other than a list");
    list.items.insert(list.items.end(), items.begin(), items.end());
  }
  void setitems() {  // SETITEM, SETITEMS
    std::vector<std::size_t> items;
    if (op_ == 's') {
      const std::size_t value = pop();
      items = {pop(), value};
    } else {
      items = pop_mark();
    }
    if (items.size() % 2 != 0) bad("SETITEMS with an odd number of keys and values");
    if (values_[top()].kind != Value::Kind::dict) bad("SETITEM on something other than a dict");
    for (std::size_t i = 0; i < items.size(); i += 2) {
      const auto k = values_[items[i]].kind;
      if (k != Value::Kind::string && k != Value::Kind::integer && k != Value::Kind::boolean &&
          k != Value::Kind::real && k != Value::Kind::tensor)
        bad(fmt::format("a dict key that is a {}", kind_name(k)));
    }
    Value& dict = values_[top()];
    dict.items.insert(dict.items.end(), items.begin(), items.end());
  }
  void binpersid() { push(persistent(pop())); }
  void reduce() {
    const std::size_t args = pop();
    const std::size_t callable = pop();
    if (values_[callable].kind != Value::Kind::global) bad("REDUCE of something that is not a global");
    if (values_[args].kind != Value::Kind::tuple) bad("REDUCE with arguments that are not a tuple");
    const std::string name = values_[callable].text;
    const auto a = values_[args].items;  // a copy: push() may move the arena
    if (name == "torch._utils._rebuild_tensor_v2") {
      push(rebuild_tensor(a));
    } else if (name == "collections.OrderedDict") {
      if (!a.empty()) bad("OrderedDict called with arguments");
      push(Value{.kind = Value::Kind::dict});  // its _metadata (BUILD) is not kept
    } else if (name == "torch.jit._pickle.restore_type_tag") {
      // (value, "Dict[str, Tensor]"): the value with its TorchScript type; the type is parsed
      // by LibTorch's type parser, which only names types.
      if (a.size() != 2 || values_[a[1]].kind != Value::Kind::string) bad("restore_type_tag without (value, type)");
      const std::string& type = values_[a[1]].text;
      if (type.size() > 256 || !is_type_text(type)) bad(fmt::format("the type tag '{}'", shown(type)));
      push_id(a[0]);                                            // the same value, shared
    } else if (name.starts_with("torch.jit._pickle.build_")) {  // a list of one kind (dict_values checks it)
      if (a.size() != 1 || values_[a[0]].kind != Value::Kind::list) bad(fmt::format("{} without one list", name));
      const Value::Kind element = name.ends_with("intlist")      ? Value::Kind::integer
                                  : name.ends_with("doublelist") ? Value::Kind::real
                                  : name.ends_with("boollist")   ? Value::Kind::boolean
                                                                 : Value::Kind::tensor;
      push(Value{.kind = Value::Kind::list, .element = element, .items = values_[a[0]].items});
    } else {
      bad(fmt::format("the global '{}' called", shown(name)));
    }
  }
  void newobj() {
    const std::size_t args = pop();
    const std::size_t cls = pop();
    if (values_[cls].kind != Value::Kind::global || !values_[cls].text.starts_with("__torch__"))
      bad("NEWOBJ of something other than a declared __torch__ class");
    if (values_[args].kind != Value::Kind::tuple || !values_[args].items.empty())
      bad("NEWOBJ with constructor arguments");
    push(Value{.kind = Value::Kind::object, .text = values_[cls].text});
  }
  void build() {
    const std::size_t state = pop();
    const std::size_t target = top();
    if (values_[state].kind != Value::Kind::dict) bad("BUILD with a state that is not a dict");
    if (values_[target].kind != Value::Kind::object && values_[target].kind != Value::Kind::dict)
      bad(fmt::format("BUILD of a {}", kind_name(values_[target].kind)));
  }
  void stop() {
    if (!marks_.empty()) bad("STOP inside a MARK");
    if (stack_.size() != 1) bad(fmt::format("STOP with {} values on the stack (expected 1)", stack_.size()));
    if (pos_ != bytes_.size()) bad(fmt::format("{} bytes after STOP", bytes_.size() - pos_));
    stopped_ = true;
  }

  std::span<const char> bytes_;
  const PickleRules& rules_;
  const Refuse& refuse_;
  std::vector<Value> values_;       // arena: ids index it (a container may hold itself: dict_values refuses it)
  std::vector<std::size_t> stack_;  // value ids
  std::vector<std::size_t> marks_;  // the stack's size at each MARK
  std::map<std::uint32_t, std::size_t> memo_;
  std::size_t pos_ = 0;
  std::size_t op_at_ = 0;
  unsigned char op_ = 0;
  bool stopped_ = false;
};

// The accepted opcodes (pickle protocol 2) and their handlers; every other byte is refused.
struct PickleChecker::OpcodeTable {
  std::array<Handler, 256> handler{};
  constexpr OpcodeTable() {
    const std::pair<unsigned char, Handler> accepted[] = {
        {0x80, &PickleChecker::proto},       {'c', &PickleChecker::global_op},    {'q', &PickleChecker::binput},
        {'r', &PickleChecker::binput},       {'h', &PickleChecker::binget},       {'j', &PickleChecker::binget},
        {')', &PickleChecker::empty_tuple},  {'}', &PickleChecker::empty_dict},   {']', &PickleChecker::empty_list},
        {'(', &PickleChecker::mark},         {'t', &PickleChecker::tuple},        {0x85, &PickleChecker::small_tuple},
        {0x86, &PickleChecker::small_tuple}, {0x87, &PickleChecker::small_tuple}, {'N', &PickleChecker::none},
        {0x88, &PickleChecker::boolean},     {0x89, &PickleChecker::boolean},     {'K', &PickleChecker::binint1},
        {'M', &PickleChecker::binint2},      {'J', &PickleChecker::binint},       {0x8a, &PickleChecker::long1},
        {'G', &PickleChecker::binfloat},     {'X', &PickleChecker::unicode},      {0x8c, &PickleChecker::unicode},
        {'a', &PickleChecker::append},       {'e', &PickleChecker::append},       {'s', &PickleChecker::setitems},
        {'u', &PickleChecker::setitems},     {'Q', &PickleChecker::binpersid},    {'R', &PickleChecker::reduce},
        {0x81, &PickleChecker::newobj},      {'b', &PickleChecker::build},        {'.', &PickleChecker::stop},
    };
    for (const auto& [op, h] : accepted) handler[op] = h;
  }
};

inline std::pair<Value::Kind, std::size_t> PickleChecker::run() {
  static constexpr OpcodeTable table;
  if (bytes_.size() < 2 || static_cast<unsigned char>(bytes_[0]) != 0x80)
    refuse_("{} is not a pickle (it does not start with the PROTO opcode)", rules_.record);
  while (!stopped_) {
    op_at_ = pos_;
    if (pos_ >= bytes_.size()) bad("the pickle ends without STOP");
    op_ = static_cast<unsigned char>(bytes_[pos_++]);
    const Handler h = table.handler[op_];
    if (h == nullptr) bad("an opcode outside the accepted subset");
    (this->*h)();
  }
  const Value& root = values_[stack_.back()];
  return {root.kind, root.items.size()};
}

inline PickleValues PickleChecker::dict_values() && {
  const std::size_t root = stack_.back();
  // Depth first from the root, on a stack of its own (a deep pickle cannot overflow the thread's).
  enum : std::uint8_t { unseen, on_path, done };
  std::vector<std::uint8_t> state(values_.size(), unseen);
  struct Frame {
    std::size_t id;
    std::size_t next;  // the next of its items to visit
  };
  std::vector<Frame> path{{root, 0}};
  state[root] = on_path;
  while (!path.empty()) {
    const std::size_t id = path.back().id;
    const Value& v = values_[id];
    if (path.back().next == v.items.size()) {
      state[id] = done;
      path.pop_back();
      continue;
    }
    const std::size_t item = v.items[path.back().next++];
    const Value::Kind kind = values_[item].kind;
    if (kind == Value::Kind::global || kind == Value::Kind::object || kind == Value::Kind::storage)
      refuse_("{} holds a {} inside its dict; only tensors and plain values are accepted", rules_.record,
              kind_name(kind));
    if (v.kind == Value::Kind::list && v.element != Value::Kind::none && kind != v.element)
      refuse_("{} holds a list of {} values with a {} in it", rules_.record, kind_name(v.element), kind_name(kind));
    if (kind != Value::Kind::tuple && kind != Value::Kind::list && kind != Value::Kind::dict) continue;
    if (state[item] == on_path)
      refuse_("{} holds a {} that holds itself; a cycle is not a dict of tensors", rules_.record, kind_name(kind));
    if (state[item] == done) continue;  // shared, as Python shares it
    if (path.size() >= PickleValues::max_depth)
      refuse_("{} nests containers more than {} deep", rules_.record, PickleValues::max_depth);
    state[item] = on_path;
    path.push_back({item, 0});
  }
  return PickleValues{std::move(values_), root};
}

// Runs `bytes` on an abstract stack; refuses anything outside the accepted subset. Returns the
// root value's kind and, for a tuple, its length.
inline std::pair<Value::Kind, std::size_t> check_pickle(std::span<const char> bytes, const PickleRules& rules,
                                                        const Refuse& refuse) {
  return PickleChecker(bytes, rules, refuse).run();
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

inline void check_records(caffe2::serialize::PyTorchStreamReader& reader, const Refuse& refuse, Root root,
                          PickleValues* values) {
  const auto names = reader.getAllRecords();
  std::set<std::string> classes;
  std::vector<std::string> code, debug;
  for (const auto& name : names) {
    const std::string_view n = name;
    if (n == "data.pkl" || n == "constants.pkl" || n == "version" || n == ".data/version" || n == "byteorder" ||
        n == ".data/serialization_id")
      continue;
    if (root == Root::dict && (n == ".format_version" || n == ".storage_alignment")) continue;
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
  if (root == Root::dict && reader.hasRecord("byteorder")) {  // torch.save's; LibTorch's writer adds none
    const auto order = record_bytes(reader, "byteorder");
    if (std::string_view(order.data(), order.size()) != "little")
      refuse("its byteorder record says '{}'; emakit reads files saved on a little-endian machine ('little')",
             shown(std::string_view(order.data(), order.size())));
  }
  const auto bytes = record_bytes(reader, "data.pkl");
  const PickleRules rules{"data.pkl", &classes, data_size};
  PickleChecker checker(bytes, rules, refuse);
  const auto [kind, n] = checker.run();
  if (root == Root::module && kind != Value::Kind::object) refuse("data.pkl holds a {}, not a module", kind_name(kind));
  if (root == Root::dict && kind != Value::Kind::dict) refuse("data.pkl holds a {}, not a dict", kind_name(kind));
  if (root == Root::dict) {
    PickleValues checked = std::move(checker).dict_values();
    if (values != nullptr) *values = std::move(checked);
  }
}

// Opens the zip with LibTorch's reader; its errors become refusals.
template <class Open>
void scan(const Open& open, const Refuse& refuse, Root root, PickleValues* values) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = open();
  } catch (const c10::Error& e) {
    refuse("it is not a readable zip archive (truncated or damaged?): {}", first_line(e));
  }
  try {
    check_records(*reader, refuse, root, values);
  } catch (const c10::Error& e) {
    refuse("a record cannot be read (truncated or damaged?): {}", first_line(e));
  }
}

}  // namespace archive_scan

namespace archive_scan {

inline void scan_bytes(std::span<const char> bytes, const Refuse& refuse, Root root, PickleValues* values) {
  scan([&] { return std::make_unique<caffe2::serialize::PyTorchStreamReader>(std::make_shared<SpanReader>(bytes)); },
       refuse, root, values);
}

}  // namespace archive_scan

EMAKIT_FUNC void scan_archive_bytes(std::span<const char> bytes, std::string_view where, archive_scan::Root root,
                                    archive_scan::PickleValues* values) {
  archive_scan::scan_bytes(bytes, archive_scan::Refuse{fmt::format("refusing {}: ", where)}, root, values);
}

EMAKIT_FUNC std::vector<char> read_scanned_file(const std::filesystem::path& path, std::string_view what,
                                                archive_scan::Root root, archive_scan::PickleValues* values) {
  std::vector<char> bytes = read_file_bytes(path, what);
  archive_scan::scan_bytes(bytes, archive_scan::Refuse{fmt::format("{}: refusing '{}': ", what, path.string())}, root,
                           values);
  EMAKIT_TEST_HOOK(if (const auto hook = testing::after_scan()) hook(path));
  return bytes;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
